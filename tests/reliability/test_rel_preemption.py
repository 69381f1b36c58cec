"""KV exhaustion with long generations: sequences are preempted (and counted), every request still
completes, and greedy outputs equal those of unpreempted runs."""

from __future__ import annotations

import grpc

from inference_service.api import pb, pb_grpc
from tests.reliability.rel_helpers import engine_metrics, greedy_alone, kv_usage, random_specs, send_all
from tests.waiting import wait_for

PREEMPTIONS = "inference_engine_preemptions_total"


def test_preempted_requests_complete_with_unpreempted_greedy_output(small_engine):
    with grpc.insecure_channel(small_engine.target) as channel:
        kv = pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest()).kv_cache
    # Three requests of 16 prompt + 64 output tokens (5 blocks each) overflow the ~11-block cache,
    # while each one alone fits.
    specs = random_specs(3, input_len=16, max_tokens=64, seed=3)
    assert len(specs) * (16 + 64) > kv.num_blocks * kv.block_size >= 16 + 64
    before = engine_metrics(small_engine)[PREEMPTIONS]
    records = send_all(small_engine.target, specs)
    assert engine_metrics(small_engine)[PREEMPTIONS] > before
    for rec in records:
        assert rec.ok, (rec.error_kind, rec.error)
        assert rec.output_tokens == 64 and rec.finish_reason == "length"
    # References one at a time: each fits the cache alone, so none of them is preempted.
    before = engine_metrics(small_engine)[PREEMPTIONS]
    for spec, rec in zip(specs, records):
        assert rec.token_ids == greedy_alone(small_engine.target, spec).token_ids, spec.index
    assert engine_metrics(small_engine)[PREEMPTIONS] == before
    wait_for(lambda: kv_usage(small_engine) == 0.0, timeout=5)
