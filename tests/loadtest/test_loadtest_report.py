"""The loadtest's metric definitions on hand-made timelines, its workloads and arrival process."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from loadtest.backends import RequestRecord
from loadtest.report import format_summary, parse_slos, summarize, tpot, ttft
from loadtest.runner import run_load
from loadtest.workload import JsonlWorkload, LengthDist, RandomTokenWorkload, arrival_offsets


def rec(index, start, chunks, end, out, error_kind=None, prompt=10):
    r = RequestRecord(index, start=start, end=end, chunk_times=list(chunks), prompt_tokens=prompt,
                      output_tokens=out, finish_reason="length")
    r.error_kind = error_kind
    return r


def test_definitions_match_vllm_bench_serve():
    # Request 0: sent at 0, chunks at 0.5, 0.6, 0.8 carrying 4 tokens, done at 0.8.
    # Request 1: sent at 1, one chunk at 1.2 with 1 token. Request 2 failed (excluded).
    records = [rec(0, 0.0, [0.5, 0.6, 0.8], 0.8, 4), rec(1, 1.0, [1.2], 1.2, 1),
               rec(2, 0.0, [0.1], 0.1, 1, error_kind="http_429")]
    assert ttft(records[0]) == pytest.approx(0.5)
    assert tpot(records[0]) == pytest.approx((0.8 - 0.5) / 3)  # (e2e - ttft) / (n_out - 1)
    assert tpot(records[1]) is None
    s = summarize(records, duration=2.0, slos={"ttft": 0.3})
    assert s["successful_requests"] == 2 and s["errors_by_kind"] == {"http_429": 1}
    assert s["ttft_ms"]["mean"] == pytest.approx(350.0)
    assert s["itl_ms"]["mean"] == pytest.approx(150.0)  # gaps 100 and 200 ms, pooled
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert s["e2el_ms"]["p99"] == pytest.approx(np.percentile([800.0, 200.0], 99))
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_token_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(12.5)
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(0.5)  # only request 1 meets ttft
    assert "http_429" in format_summary(s)


def test_slo_parsing():
    assert parse_slos(["ttft:500", "e2el:2000"]) == {"ttft": 0.5, "e2el": 2.0}
    with pytest.raises(ValueError):
        parse_slos(["itl:5"])


def test_poisson_and_gamma_arrivals_have_the_requested_rate():
    for burstiness in (1.0, 0.5, 4.0):
        offsets = [t for _, t in zip(range(20001), arrival_offsets(10.0, burstiness, seed=1))]
        gaps = np.diff(offsets)
        assert offsets[-1] / 20000 == pytest.approx(0.1, rel=0.03)
        # Gamma(k, θ) gaps: coefficient of variation 1/sqrt(k).
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert list(zip(range(3), arrival_offsets(math.inf))) == [(0, 0.0), (1, 0.0), (2, 0.0)]


def test_random_prompts_are_reproducible_and_follow_the_length_distribution():
    w = RandomTokenWorkload(LengthDist(100, "uniform", 0.5), LengthDist(20), seed=3, token_range=(1000, 2000))
    specs = [w(i) for i in range(400)]
    assert [s.prompt_token_ids for s in specs[:5]] == [w(i).prompt_token_ids for i in range(5)]
    lengths = [len(s.prompt_token_ids) for s in specs]
    assert min(lengths) >= 50 and max(lengths) <= 150 and np.mean(lengths) == pytest.approx(100, rel=0.05)
    assert all(1000 <= t < 2000 for s in specs for t in s.prompt_token_ids)
    assert {s.max_tokens for s in specs} == {20}


def test_jsonl_workload(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [{"prompt": "hi", "max_tokens": 3},
                                                      {"messages": [{"role": "user", "content": "yo"}]}]))
    w = JsonlWorkload(str(path), LengthDist(7))
    assert (w(0).prompt, w(0).max_tokens) == ("hi", 3)
    assert (w(1).messages[0]["content"], w(1).max_tokens) == ("yo", 7)
    assert w(2).prompt == "hi"  # cycles


def test_runner_caps_concurrency():
    in_flight, peak = 0, 0

    async def send(spec, record):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        record.finish_reason, record.output_tokens = "length", 1
        record.finish(0.0, completed=True)

    result = asyncio.run(run_load(send, lambda i: RandomTokenWorkload(LengthDist(4), LengthDist(1))(i),
                                  num_requests=20, max_concurrency=3, progress=False))
    assert peak == 3 and len(result.records) == 20 and all(r.ok for r in result.records)
