"""The engine's latency split: a request's queue time ends when its first step is launched, and the
prefill time runs from there to its first token (they sum to the time to first token)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from inference_service.metrics import MetricsRecorder


def _step_of(*seqs):
    return SimpleNamespace(scheduled=[SimpleNamespace(seq=seq) for seq in seqs], num_batched_tokens=len(seqs))


def test_queue_time_ends_at_the_first_launch_and_prefill_time_takes_the_step():
    recorder = MetricsRecorder()
    now = time.monotonic()
    seq = SimpleNamespace(request_id="r1", arrival_time=now - 1.0)
    recorder.on_step(_step_of(seq), duration_s=0.4)  # launched 0.4 s ago, 0.6 s after arrival
    recorder.on_first_token(time.monotonic() - seq.arrival_time, seq)
    recorder.on_step(_step_of(seq), duration_s=0.01)  # a later step of the same request: no queue time again
    step, first_token, later_step = recorder.take()
    (queue_time,) = step[3]
    assert queue_time == pytest.approx(0.6, abs=0.05)
    assert later_step[3] == []
    _, ttft_s, prefill_s = first_token
    assert prefill_s == pytest.approx(0.4, abs=0.05)
    assert queue_time + prefill_s == pytest.approx(ttft_s, abs=0.01)
