"""The embedded SmolLM2 GGUF, run through the paged decoder, must match HF transformers token for token."""

from __future__ import annotations

from conftest import NEW_TOKENS
from harness import PagedHarness


def test_greedy_matches_hf_one_sequence_at_a_time(smollm, smollm_prompts, hf_reference_tokens):
    # Two chat prompts and one raw one alone (bs=1 decode path); the batched test covers all eight.
    for index in (0, 3, 4):
        ids, expected = smollm_prompts[index], hf_reference_tokens[index]
        harness = PagedHarness(smollm.model, num_blocks=64, block_size=16, seed=len(ids))
        got = harness.generate([ids], NEW_TOKENS)[0]
        assert got == expected, smollm.tokenizer.decode(ids)


def test_greedy_matches_hf_batched_and_chunked(smollm, smollm_prompts, hf_reference_tokens):
    """All 8 prompts in one batch: prefill in chunks of 7 (mixed prefill/decode steps), then batched decode."""
    harness = PagedHarness(smollm.model, num_blocks=128, block_size=8, seed=1)
    got = harness.generate(smollm_prompts, NEW_TOKENS, prefill_chunk=7)
    assert got == hf_reference_tokens


def test_capital_of_france(smollm, smollm_prompts):
    harness = PagedHarness(smollm.model)
    text = smollm.tokenizer.decode(harness.generate([smollm_prompts[0]], 10)[0])
    assert text.startswith("The capital of France is Paris.")
