"""The engine core in its own process: where it runs, aborts across the boundary, its death, SIGTERM drain."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_service.api import pb, pb_grpc
from tests.grpc_client import GenerateStream, greedy, kv_cache_usage, start_engine
from tests.waiting import wait_for

SMALL = ("--max-model-len", "512", "--kv-cache-memory", "32")


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def core_pid(engine) -> int:
    """The engine core: the server's one child started by multiprocessing's spawn."""
    pids = []
    for pid in child_pids(engine.process.pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                pids.append(pid)
    assert len(pids) == 1, f"expected one engine core process, found {pids}"
    return pids[0]


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def start_long(stream: GenerateStream, request_id: str) -> None:
    """Starts a request that runs until told otherwise and waits until it produced tokens (it is in the core)."""
    stream.start(request_id, text="Count from one to a thousand:", **greedy(400, ignore_eos=True))
    while len(stream.results[request_id].tokens) < 2:
        stream.next()


@pytest.fixture
def engine(tmp_path):
    proc = start_engine(*SMALL, "--engine-core-process", log_path=str(tmp_path / "engine.log"))
    yield proc
    proc.stop()


def test_core_runs_in_its_own_process_and_cancel_frees_blocks_there(engine):
    core = core_pid(engine)
    assert core != engine.process.pid
    # Both processes keep their startup heaps out of the collector's walks
    log = engine.log()
    assert "gc_heap: froze" in log and "gc_heap[core]: froze" in log
    with grpc.insecure_channel(engine.target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        stream = GenerateStream(stub)
        start_long(stream, "long")
        assert kv_cache_usage(engine) > 0.0  # the core's gauge, on the front end's /metrics
        stream.cancel("long")
        stream.wait_done({"long"})
        assert stream.results["long"].completions[0].finish_reason == pb.FINISH_REASON_ABORT
        assert stream.results["long"].usage.completion_tokens < 400
        # The abort's state comes with the same step output as the last delta: freed before the client hears.
        assert kv_cache_usage(engine) == 0.0
        start_long(stream, "gone")
        assert kv_cache_usage(engine) > 0.0
        stream._call.cancel()  # a client disconnect aborts in the core as well
        wait_for(lambda: kv_cache_usage(engine) == 0.0, timeout=10)


def test_in_process_mode_has_no_core_process(tmp_path):
    engine = start_engine(*SMALL, "--engine-in-process", log_path=str(tmp_path / "engine.log"))
    try:
        assert [pid for pid in child_pids(engine.process.pid) if is_running(pid)] == []
        with grpc.insecure_channel(engine.target) as channel:
            stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
            stream.start("a", text="Hello", **greedy(5))
            stream.wait_done({"a"})
            assert stream.results["a"].usage.completion_tokens == 5
    finally:
        assert engine.stop() == 0


def test_core_crash_not_serving_unavailable_and_nonzero_exit(engine):
    core = core_pid(engine)
    with grpc.insecure_channel(engine.target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
        start_long(stream, "in-flight")
        os.kill(core, signal.SIGKILL)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stream.wait_done({"in-flight"})
        error = stream.results["in-flight"].error
        assert error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "engine core process died" in error.message
    assert engine.process.wait(30) == 1
    assert "the engine core process died" in engine.log()


def test_sigterm_drains_in_flight_requests_then_both_processes_end(engine):
    core = core_pid(engine)
    with grpc.insecure_channel(engine.target) as channel:
        stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
        stream.start("draining", text="Count from one to a thousand:", **greedy(60, ignore_eos=True))
        while len(stream.results["draining"].tokens) < 2:
            stream.next()
        engine.process.send_signal(signal.SIGTERM)
        stream.wait_done({"draining"})
        result = stream.results["draining"]
        assert result.error is None
        assert result.usage.completion_tokens == 60
        assert result.completions[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert engine.process.wait(30) == 0
    assert not is_running(core)


@pytest.mark.parametrize(("device", "flag", "tp", "in_process"), [
    ("cpu", None, 1, True),  # the CPU default: measured faster in process (server._core_in_process)
    ("cuda", None, 1, False),
    ("cpu", False, 1, False),
    ("cuda", True, 1, True),
    ("cuda", False, 2, True),  # tensor-parallel workers report to rank 0's process
])
def test_where_the_core_runs(device, flag, tp, in_process):
    from inference_service.server import _core_in_process

    engine_config = SimpleNamespace(device=device, tensor_parallel_size=tp)
    assert _core_in_process(engine_config, SimpleNamespace(engine_in_process=flag)) is in_process


def test_core_flags_parse():
    from inference_service.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).engine_in_process is None
    assert parse(["serve", "--engine-in-process"]).engine_in_process is True
    assert parse(["serve", "--engine-core-process"]).engine_in_process is False
    with pytest.raises(SystemExit):
        parse(["serve", "--engine-in-process", "--engine-core-process"])
