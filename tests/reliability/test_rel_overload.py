"""Overload at 10x the waiting-queue limit: the excess is refused at once (RESOURCE_EXHAUSTED / 429),
every accepted request completes with the output it would have had alone, no KV block leaks."""

from __future__ import annotations

import time

import grpc

from inference_service.api import pb, pb_grpc
from tests.grpc_client import GenerateStream, greedy
from tests.reliability.conftest import MAX_WAITING
from tests.reliability.rel_helpers import engine_metrics, greedy_alone, kv_usage, random_specs, send_all
from tests.waiting import wait_for

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
NUM_REQUESTS = 10 * MAX_WAITING


def test_grpc_burst_refuses_the_excess_quickly_and_serves_the_rest(small_engine):
    specs = random_specs(NUM_REQUESTS, seed=1)
    with grpc.insecure_channel(small_engine.target) as channel:
        stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
        sent = time.monotonic()
        for s in specs:
            stream.start(str(s.index), token_ids=pb.TokenIds(ids=s.prompt_token_ids), **greedy(s.max_tokens))
        ids = {str(s.index) for s in specs}
        refused_at = {}
        while not all(stream.results[i].usage is not None or stream.results[i].error is not None for i in ids):
            r = stream.next()
            if r.HasField("error"):
                refused_at[r.request_id] = time.monotonic() - sent
        stream.drain()
    refused = {i for i in ids if stream.results[i].error is not None}
    accepted = ids - refused
    assert {stream.results[i].error.code for i in refused} == {RESOURCE_EXHAUSTED}
    # Accepted: up to 4 running + 4 waiting, plus a few taken as earlier ones finish mid-burst.
    assert len(refused) >= NUM_REQUESTS // 2, "the excess must be refused, not queued"
    assert len(accepted) >= MAX_WAITING
    # Refusals do not wait for a model step: all of them arrive within a second of the burst.
    assert max(refused_at.values()) < 1.0
    for i in accepted:
        result = stream.results[i]
        assert result.completions[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert result.tokens == greedy_alone(small_engine.target, specs[int(i)]).token_ids, i
    wait_for(lambda: kv_usage(small_engine) == 0.0, timeout=5)


def test_http_burst_gets_429_for_the_excess_and_correct_answers_for_the_rest(small_engine, small_proxy):
    specs = random_specs(NUM_REQUESTS, seed=2)
    records = send_all(small_proxy.url, specs, http=True)
    refused = [r for r in records if not r.ok]
    accepted = [r for r in records if r.ok]
    assert {r.error_kind for r in refused} == {"http_429"}
    assert len(refused) >= NUM_REQUESTS // 2
    assert max(r.end - r.start for r in refused) < 2.0
    for r in accepted:
        assert r.output_tokens == specs[r.index].max_tokens and r.finish_reason == "length"
        assert r.text == greedy_alone(small_engine.target, specs[r.index]).text, r.index
    wait_for(lambda: kv_usage(small_engine) == 0.0, timeout=5)
    assert engine_metrics(small_engine)["inference_engine_requests_running"] == 0
