from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI

from rest_proxy.config import ProxyConfig
from tests.proxy.fake_engine import FakeEngineServer, free_port
from tests.proxy.grammars import byte_tokenizer_in
from tests.proxy.servers import ProxyServer

_MAX_STARTUP_S = 300
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def fake_server():
    server = FakeEngineServer().start()
    yield server
    server.stop()


@pytest.fixture
def engine(fake_server):
    """The scripted engine, reset for each test."""
    fake_server.engine.reset()
    yield fake_server.engine
    fake_server.engine.reset()


@pytest.fixture(scope="session")
def proxy(fake_server):
    """A proxy in front of the fake engine, without auth or MCP."""
    server = ProxyServer(ProxyConfig(engines=[fake_server.target])).start()
    yield server
    server.stop()


@pytest.fixture
def client(proxy, engine) -> OpenAI:
    return OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def start_proxy():
    """Start extra proxies with their own config; all are stopped after the test."""
    started: list[ProxyServer] = []

    def start(**kwargs) -> ProxyServer:
        server = ProxyServer(ProxyConfig(**kwargs)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# -- the real engine with the embedded SmolLM2, shared by every module that needs it ---------------------
def launch_engine(log_dir, *args: str):
    """Start the real engine (the embedded SmolLM2) with extra flags; yields its target once SERVING."""
    port = free_port()
    log_path = log_dir / "engine.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "inference_service.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--max-waiting-requests", "2", *args],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    target = f"127.0.0.1:{port}"
    # NOTE: generous: loading and warming the model takes ~15 s alone, minutes on a shared, loaded machine.
    deadline = time.monotonic() + _MAX_STARTUP_S
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.poll() is not None:
                pytest.fail(f"engine exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"engine not SERVING within {_MAX_STARTUP_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
    yield target
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="session")
def real_engine(tmp_path_factory):
    yield from launch_engine(tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="session")
def real_proxy(real_engine):
    server = ProxyServer(ProxyConfig(engines=[real_engine])).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sdk(real_proxy) -> OpenAI:
    return OpenAI(base_url=real_proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model(sdk) -> str:
    models = sdk.models.list().data
    assert len(models) == 1
    return models[0].id


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory):
    """llguidance's tokenizer over a byte-level vocabulary: any text is some token sequence."""
    return byte_tokenizer_in(str(tmp_path_factory.mktemp("bytes")))
