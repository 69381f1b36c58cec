"""Shared fixtures of the operations tests: two real engine processes, started once and in parallel."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.grpc_client import EngineProcess, start_engine

# Engine "a" gets a KV cache of 4 MiB (5 blocks of 16 tokens with SmolLM2-135M) and at most 3 running
# sequences, so a small burst of requests is enough to make it queue and preempt; "b" is an ordinary small
# engine. Both serve behind Envoy in test_ops_envoy.py, which kills "b" at its end.
ENGINE_ARGS = {
    "a": ("--kv-cache-memory", "4", "--max-model-len", "1024", "--max-num-seqs", "3"),
    "b": ("--kv-cache-memory", "64", "--max-model-len", "1024"),
}


@pytest.fixture(scope="session")
def engines(tmp_path_factory) -> dict[str, EngineProcess]:
    logs = tmp_path_factory.mktemp("engines")
    with ThreadPoolExecutor(len(ENGINE_ARGS)) as pool:
        futures = {name: pool.submit(start_engine, *args, log_path=str(logs / f"{name}.log"))
                   for name, args in ENGINE_ARGS.items()}
        started, errors = {}, []
        for name, future in futures.items():
            try:
                started[name] = future.result()
            except Exception as e:  # noqa: BLE001 - stop the other one before failing
                errors.append(e)
    if errors:
        for engine in started.values():
            engine.stop()
        raise errors[0]
    yield started
    for engine in started.values():
        engine.stop()


@pytest.fixture(scope="session")
def traffic(engines, tmp_path_factory):
    """Scrapes of engine "a" and of proxies around real traffic, with what the clients were told."""
    from tests.ops.ops_traffic import run_traffic

    return run_traffic(engines["a"], tmp_path_factory.mktemp("traffic"))
