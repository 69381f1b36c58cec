"""One small engine shared by the reliability tests that do not stop it, and a proxy in front of it.

The engine is deliberately cramped so faults are cheap to provoke: 4 running sequences, a waiting
queue of 4, about 11 KV blocks of 16 tokens (8 MiB), and 1 MiB gRPC messages.
"""

from __future__ import annotations

import pytest

from rest_proxy.config import ProxyConfig
from tests.grpc_client import start_engine
from tests.proxy.servers import ProxyServer

MAX_WAITING = 4
SMALL_ENGINE_ARGS = ("--max-model-len", "512", "--kv-cache-memory", "8", "--max-num-seqs", "4",
                     "--max-waiting-requests", str(MAX_WAITING), "--max-message-size", "1", "--shutdown-timeout", "5")


@pytest.fixture(scope="session")
def small_engine(tmp_path_factory):
    log = tmp_path_factory.mktemp("rel-engine") / "engine.log"
    engine = start_engine(*SMALL_ENGINE_ARGS, log_path=str(log))
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def small_proxy(small_engine):
    """The proxy in this process (a thread): enough where no signal has to reach it."""
    server = ProxyServer(ProxyConfig(engines=[small_engine.target])).start()
    yield server
    server.stop()
