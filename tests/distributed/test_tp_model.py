"""Two ranks on gloo give the same greedy tokens and logits (fp32, within 1e-5) as one process: on the
torch stack, and on the fused stack's folded decode path (Triton, interpreted), where rank 0 alone adds
the residual stream and the biases of o_proj and down_proj before the all-reduce."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from harness import PagedHarness
from tiny_models import make_hf_model, save_hf_model
from tp_ranks import fold_fp32_gemv, free_port, run_rank, teacher_forced_logits

from inference_service.model.loader import load_model

PROMPTS = [[256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], [256, 84, 80, 33]]
NUM_NEW_TOKENS = 6
CHUNK = 5  # the first prompt prefills over three steps

CASES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    # One KV head for two ranks: replicated; a vocabulary of 301 rows: the last rank's shard padded;
    # biases on q, k, v (split) and o (row-parallel: added once).
    "llama-kv1-odd-vocab-bias": ("llama", {"num_key_value_heads": 1, "vocab_size": 301, "attention_bias": True}),
}
# One case (the interpreted kernels take ~30 s a case): Qwen2's q, k, v biases split, one KV head, the last
# rank's vocabulary padded. (The fused stack refuses an o_proj bias: `FamilySpec.fused_path_gaps`.)
FOLDED_CASES = {"qwen2-bias-kv1-odd-vocab": ("qwen2", {"num_key_value_heads": 1, "vocab_size": 301})}


def _two_rank_runs(folder, cases: dict, folded: bool) -> dict:
    """For every case: (greedy tokens of one process, its logits, rank 0's logits of two ranks); the
    two ranks run every case in one pair of processes."""
    references, jobs = {}, []
    for case in sorted(cases):
        family, overrides = cases[case]
        path = save_hf_model(make_hf_model(family, seed=3, **overrides), str(folder / case))
        reference = load_model(path, dtype=torch.float32, attention_backend="triton" if folded else "auto").model
        generated = PagedHarness(reference).generate(PROMPTS, NUM_NEW_TOKENS, prefill_chunk=CHUNK)
        forced = [tokens[:-1] for tokens in generated]
        references[case] = (generated, teacher_forced_logits(reference, PROMPTS, forced, CHUNK))
        jobs.append((path, PROMPTS, forced, CHUNK))
    out_file = str(folder / "rank0_logits.pt")
    mp.start_processes(run_rank, args=(2, free_port(), jobs, out_file, folded), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(out_file)["logits"]
    return {case: (*references[case], got[i]) for i, case in enumerate(sorted(cases))}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    return _two_rank_runs(tmp_path_factory.mktemp("tp_cases"), CASES, folded=False)


@pytest.fixture(scope="module")
def two_rank_folded_runs(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        from inference_service.model import fused_stack
        from inference_service.model.decoder import DecoderModel

        patch.setattr(fused_stack, "uses_gemv", fused_stack.uses_gemv)  # both restored after
        patch.setattr(DecoderModel, "__init__", DecoderModel.__init__)
        fold_fp32_gemv()
        return _two_rank_runs(tmp_path_factory.mktemp("tp_folded"), FOLDED_CASES, folded=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_match_one_process(case, two_rank_runs):
    _assert_same_logits_and_tokens(*two_rank_runs[case])


@pytest.mark.parametrize("case", sorted(FOLDED_CASES))
def test_two_ranks_match_one_process_on_the_folded_decode_path(case, two_rank_folded_runs):
    _assert_same_logits_and_tokens(*two_rank_folded_runs[case])


def _assert_same_logits_and_tokens(generated, expected, got) -> None:
    forced = [tokens[:-1] for tokens in generated]
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in expected]
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
    # The greedy tokens: a sequence's first from its last prefill step's row, then one a decode step.
    num_prefill_steps = len(expected) - len(forced[0])
    tp_tokens = []
    for i, prompt in enumerate(PROMPTS):
        last_step = -(-len(prompt) // CHUNK) - 1
        row = sum(len(p) > last_step * CHUNK for p in PROMPTS[:i])
        first = int(got[last_step][row].argmax())
        tp_tokens.append([first] + [int(t[i].argmax()) for t in got[num_prefill_steps:]])
    assert tp_tokens == generated
