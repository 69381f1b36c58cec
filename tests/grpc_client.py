"""Test helpers: start a real engine process on loopback and talk to it over a bidi stream."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_service.api import pb, pb_grpc

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EngineProcess:
    process: subprocess.Popen
    port: int
    metrics_port: int
    log_path: str

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_engine(*args: str, log_path: str, timeout_s: float = 180, port: int | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> EngineProcess:
    """Starts `inference-service serve` on free loopback ports (or the given gRPC `port`, to restart
    an engine where its clients expect it) and waits for health SERVING (over TLS with `credentials`)."""
    port, metrics_port = port or free_port(), free_port()
    cmd = [sys.executable, "-m", "inference_service.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", str(metrics_port), *args]
    log = open(log_path, "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    engine = EngineProcess(process, port, metrics_port, log_path)
    deadline = time.monotonic() + timeout_s
    channel = (grpc.secure_channel(engine.target, credentials) if credentials is not None
               else grpc.insecure_channel(engine.target))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"engine exited with {process.returncode}:\n{engine.log()}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return engine
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    engine.stop()
    raise RuntimeError(f"engine not SERVING after {timeout_s}s:\n{engine.log()}")


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    logprobs: list = field(default_factory=list)
    stop_reason: str = ""


@dataclass
class RequestResult:
    completions: dict[int, Completion] = field(default_factory=lambda: defaultdict(Completion))
    usage: pb.Usage | None = None
    error: pb.Error | None = None
    num_messages: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.completions[0].token_ids

    @property
    def text(self) -> str:
        return self.completions[0].text


class GenerateStream:
    """One bidi Generate stream: send starts/cancels, collect responses by request id."""

    def __init__(self, stub: pb_grpc.InferenceServiceStub, timeout: float | None = 120, metadata=None):
        self._requests: queue.Queue = queue.Queue()
        self._call = stub.Generate(iter(self._requests.get, None), timeout=timeout, metadata=metadata)
        self.results: dict[str, RequestResult] = defaultdict(RequestResult)
        self.errors: list[pb.GenerateResponse] = []  # rejected messages, in arrival order

    def start(self, request_id: str, **fields) -> None:
        self._requests.put(pb.GenerateRequest(start=pb.StartGeneration(request_id=request_id, **fields)))

    def cancel(self, request_id: str) -> None:
        self._requests.put(pb.GenerateRequest(cancel=pb.CancelGeneration(request_id=request_id)))

    def close(self) -> None:
        self._requests.put(None)

    def next(self) -> pb.GenerateResponse:
        response = next(self._call)
        self._record(response)
        return response

    def _record(self, r: pb.GenerateResponse) -> None:
        result = self.results[r.request_id]
        result.num_messages += 1
        if r.HasField("error"):
            result.error = r.error
            self.errors.append(r)
            return
        c = result.completions[r.index]
        c.token_ids.extend(r.token_ids)
        c.text += r.text
        c.logprobs.extend(r.logprobs)
        if r.finish_reason:
            c.finish_reason, c.stop_reason = r.finish_reason, r.stop_reason
        if r.HasField("usage"):
            result.usage = r.usage

    def wait_done(self, request_ids: set[str]) -> None:
        """Reads until every id in `request_ids` got its usage (or an error)."""
        while not all(self.results[i].usage is not None or self.results[i].error is not None for i in request_ids):
            self.next()

    def drain(self) -> None:
        """Closes the sending side and reads until the server ends the stream."""
        self.close()
        for response in self._call:
            self._record(response)


def greedy(max_tokens: int, **stopping) -> dict:
    return {"sampling": pb.SamplingParams(temperature=0.0), "stopping": pb.StoppingCriteria(max_tokens=max_tokens, **stopping)}


def kv_cache_usage(engine: EngineProcess) -> float:
    """The engine's KV-cache usage ratio, read from its Prometheus endpoint."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{engine.metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("inference_engine_kv_cache_usage_ratio{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("kv cache usage metric missing")
