"""The load tester meets a refused request the way a client should: an error the engine answers in band ends that
request's record at once, with the engine's status and message, beside requests that complete."""

from __future__ import annotations

from loadtest.workload import RequestSpec
from tests.reliability.rel_helpers import send_all

VOCAB_SIZE = 49152  # the embedded SmolLM2's


def test_an_in_band_error_ends_its_record_with_the_engine_status(small_engine):
    bad = RequestSpec(index=0, max_tokens=4, prompt_token_ids=[5, VOCAB_SIZE + 7, 9])
    good = RequestSpec(index=1, max_tokens=4, prompt_token_ids=[1000, 2000, 3000], ignore_eos=True)
    records = {r.index: r for r in send_all(small_engine.target, [bad, good], timeout=60)}
    assert not records[0].ok
    assert records[0].error_kind == "grpc_INVALID_ARGUMENT"
    assert f"token_ids[1] = {VOCAB_SIZE + 7} is outside the vocabulary" in records[0].error
    assert records[1].ok and records[1].output_tokens == 4
    # The refused record ended with its answer, before the other's four tokens: a stream left open after the
    # error waits for more requests until the timeout (60 s) and ends last
    assert records[0].end < records[1].end
