from __future__ import annotations

import pytest
from openai import OpenAI

from rest_proxy.config import ProxyConfig
from tests.proxy.fake_engine import FakeEngineServer
from tests.proxy.servers import ProxyServer


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
