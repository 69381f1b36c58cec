"""A client that goes away mid-stream: the engine aborts its request within a step or so and
frees its KV blocks, whether the client spoke gRPC or HTTP through the proxy."""

from __future__ import annotations

import json

import grpc
import httpx

from inference_service.api import pb_grpc
from tests.grpc_client import GenerateStream, greedy
from tests.reliability.rel_helpers import engine_metrics, kv_usage
from tests.waiting import wait_for

MAX_TOKENS = 300  # ~10 s of decoding: a request left running would be obvious
# Tokens the engine may compute after the client's last one: the ones in flight on the wire plus
# the step during which the abort arrives.
SLACK = 6
ABORTED = "inference_engine_request_success_total{finished_reason=abort}"
GENERATED = "inference_engine_generation_tokens_total"


def _counters(engine) -> tuple[float, float]:
    m = engine_metrics(engine)
    return m.get(ABORTED, 0.0), m[GENERATED]


def _check_aborted_promptly(engine, before: tuple[float, float], num_received: int) -> None:
    # Freed blocks within 2 s (a shared CPU may be slow), where finishing would take ~10 s.
    wait_for(lambda: kv_usage(engine) == 0.0 and _counters(engine)[0] == before[0] + 1, timeout=2.0)
    generated = _counters(engine)[1] - before[1]
    assert num_received <= generated <= num_received + SLACK, (num_received, generated)


def test_grpc_disconnect_aborts_within_a_step(small_engine):
    before = _counters(small_engine)
    with grpc.insecure_channel(small_engine.target) as channel:
        stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
        stream.start("gone", text="Write a long story about a dragon:", **greedy(MAX_TOKENS, ignore_eos=True))
        while len(stream.results["gone"].tokens) < 5:
            stream.next()
        stream._call.cancel()  # the client vanishes without a CancelGeneration
    _check_aborted_promptly(small_engine, before, len(stream.results["gone"].tokens))


def test_http_disconnect_aborts_within_a_step(small_engine, small_proxy):
    before = _counters(small_engine)
    model = httpx.get(small_proxy.url + "/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Write a long story about a dragon:", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True, "logprobs": 0}
    num_received = 0
    with httpx.Client(timeout=30) as client, client.stream("POST", small_proxy.url + "/v1/completions",
                                                          json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                # A chunk may carry several tokens (the engine coalesces what a slow reader has not
                # taken yet); its logprobs list them one by one.
                num_received += len(json.loads(line[len("data: "):])["choices"][0]["logprobs"]["tokens"])
            if num_received >= 5:
                break
    # Leaving the block closed the connection.
    _check_aborted_promptly(small_engine, before, num_received)
