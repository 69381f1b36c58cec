"""Helpers of the reliability tests: engine metrics, a real proxy process, polling, load via `loadtest`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest.backends import GrpcBackend, OpenAIBackend, RequestRecord
from loadtest.runner import run_load
from loadtest.workload import LengthDist, RandomTokenWorkload, RequestSpec
from tests.grpc_client import REPO_ROOT, EngineProcess, free_port


def engine_metrics(engine: EngineProcess) -> dict[str, float]:
    """Every sample of the engine's /metrics as {"name{label=value,...}": value} (model label dropped)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{engine.metrics_port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def kv_usage(engine: EngineProcess) -> float:
    return engine_metrics(engine)["inference_engine_kv_cache_usage_ratio"]



@dataclass
class ProxyProcess:
    process: subprocess.Popen
    port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_proxy(engine_target: str, *args: str, log_path: str, timeout_s: float = 60) -> ProxyProcess:
    """Starts `rest-proxy serve` as its own process (signals reach it for real) and waits for a model."""
    port = free_port()
    cmd = [sys.executable, "-m", "rest_proxy.cli", "serve", "--engine", engine_target, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", *args]
    proxy = ProxyProcess(subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                                          cwd=REPO_ROOT), port, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proxy.process.poll() is not None:
            raise RuntimeError(f"proxy exited with {proxy.process.returncode}:\n{proxy.log()}")
        try:
            if httpx.get(proxy.url + "/v1/models", timeout=1).json()["data"]:
                return proxy
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    proxy.stop()
    raise RuntimeError(f"proxy serves no model after {timeout_s}s:\n{proxy.log()}")


def random_specs(n: int, *, input_len: int = 16, max_tokens: int = 8, seed: int = 0) -> list[RequestSpec]:
    workload = RandomTokenWorkload(LengthDist(input_len), LengthDist(max_tokens), ignore_eos=True, seed=seed)
    return [workload(i) for i in range(n)]


async def _send_all(backend, specs: list[RequestSpec], on_done=None) -> list[RequestRecord]:
    await backend.open()
    try:
        by_index = {s.index: s for s in specs}
        result = await run_load(backend.send, lambda i: by_index[specs[i].index], num_requests=len(specs),
                                progress=False, on_done=on_done)
        return result.records
    finally:
        await backend.close()


def send_all(target: str, specs: list[RequestSpec], *, http: bool = False, timeout: float = 120,
             on_done=None) -> list[RequestRecord]:
    """Sends every spec at once (engine over gRPC, or the proxy at `target` over HTTP) and returns
    their records; `loadtest` classifies failures by kind, cut-off streams included."""
    backend = OpenAIBackend(target, timeout=timeout) if http else GrpcBackend(target, timeout=timeout)
    return asyncio.run(_send_all(backend, specs, on_done))


def greedy_alone(target: str, spec: RequestSpec) -> RequestRecord:
    """The reference: one request on an otherwise idle engine."""
    (rec,) = send_all(target, [spec])
    assert rec.ok, rec.error
    return rec
