"""The priority scheduling policy over gRPC: with one running slot, queued requests start (first token)
lowest priority value first, whatever order they were sent in."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from inference_service.api import pb, pb_grpc
from tests.grpc_client import EngineProcess, GenerateStream, start_engine

# Sent in this order; expected to start sorted by priority. (No ties: requests are tokenized on a thread pool,
# so their arrival order need not be the order they were sent in.)
QUEUED = [("p5", 5), ("m3", -3), ("p0", 0), ("p9", 9), ("m7", -7)]
# NOTE: generous: on a shared 2-core machine a step can take a second; nothing here waits this long
# unless the engine is broken.
_MAX_WAIT_S = 120


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = start_engine("--scheduling-policy", "priority", "--max-num-seqs", "1", "--kv-cache-memory", "64",
                        log_path=str(log))
    yield proc
    proc.stop()


def num_waiting(engine: EngineProcess) -> int:
    """The engine's waiting sequences, from its Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{engine.metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("inference_engine_requests_waiting{"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("requests_waiting metric missing")


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + _MAX_WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_queued_requests_start_lowest_priority_value_first(engine):
    with grpc.insecure_channel(engine.target) as channel:
        stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
        arrivals: list[pb.GenerateResponse] = []  # every response, in the order the stream delivered them

        def read() -> None:
            try:
                while True:
                    arrivals.append(stream.next())
            except (StopIteration, grpc.RpcError):
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        # A long request takes the only running slot (it would run to the context's end; it is cancelled).
        stream.start("long", text="Once upon a time", sampling=pb.SamplingParams(temperature=0.0),
                     stopping=pb.StoppingCriteria(max_tokens=1500, ignore_eos=True))
        wait_until(lambda: any(r.request_id == "long" and r.token_ids for r in arrivals), "the long request to run")
        for request_id, priority in QUEUED:
            stream.start(request_id, text=f"Request {request_id}:", priority=priority,
                         sampling=pb.SamplingParams(temperature=0.0),
                         stopping=pb.StoppingCriteria(max_tokens=2, ignore_eos=True))
        wait_until(lambda: num_waiting(engine) == len(QUEUED), "every request to be queued")
        assert not any(r.request_id == "long" and r.finish_reason for r in arrivals)  # still running
        stream.cancel("long")  # frees the slot: the queue drains in its order
        done = {request_id for request_id, _ in QUEUED}
        wait_until(lambda: done <= {r.request_id for r in arrivals if r.HasField("usage")}, "the queued requests")
        stream.close()
        reader.join(timeout=_MAX_WAIT_S)

    assert not any(r.HasField("error") for r in arrivals)
    long_finish = [r.finish_reason for r in arrivals if r.request_id == "long" and r.finish_reason]
    assert long_finish == [pb.FINISH_REASON_ABORT]
    first_token_order = []
    for r in arrivals:
        if r.request_id != "long" and r.token_ids and r.request_id not in first_token_order:
            first_token_order.append(r.request_id)
    assert first_token_order == ["m7", "m3", "p0", "p5", "p9"]
