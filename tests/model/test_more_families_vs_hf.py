"""Gemma 2, Gemma 3, Phi-3 (LongRoPE), StableLM, GLM-4, Yi and windowed Mistral / Phi-3: tiny random
checkpoints built with transformers' own config classes, against HF transformers in fp32.

Per family: prefill logits (in chunks over cached blocks) and the logits of 32 decode steps through
the paged cache within 1e-4, 32 greedy tokens identical, and a batch of prompts equal to each alone.
The windows (8 to 12 tokens) are far shorter than the 37-token prompt, so they mask for real; the
soft caps are small enough to bend the scores."""

from __future__ import annotations

import pytest
import torch

from harness import PagedHarness
from tiny_models import VOCAB_SIZE, load_hf_case

transformers = pytest.importorskip("transformers")

NUM_DECODE = 32
_SHORT = [1.0 + 0.1 * i for i in range(8)]
_LONG = [2.0 + 0.3 * i for i in range(8)]
CASES = {
    "gemma2": ("gemma2", dict(sliding_window=8, attn_logit_softcapping=3.0, final_logit_softcapping=6.0,
                              query_pre_attn_scalar=24, num_hidden_layers=3)),
    "gemma3": ("gemma3", dict(sliding_window=8, final_logit_softcapping=8.0, query_pre_attn_scalar=16,
                              num_hidden_layers=3,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # The context crosses original_max_position_embeddings (48) during decode: short, then long factors.
    "phi3_longrope": ("phi3", dict(original_max_position_embeddings=48,
                                   rope_scaling={"rope_type": "longrope", "short_factor": _SHORT,
                                                 "long_factor": _LONG})),
    "phi3_partial_window": ("phi3", dict(partial_rotary_factor=0.75, sliding_window=12)),
    "stablelm": ("stablelm", dict(use_qkv_bias=True)),
    "glm4": ("glm4", {}),
    "mistral_window": ("mistral", dict(sliding_window=10)),
    # Yi is the Llama architecture at its own sizes: GQA 4:1 here, a 5M rope base, eps 1e-5.
    "yi": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=5e6, rms_norm_eps=1e-5)),
}
PROMPT = [int(x) for x in torch.randint(3, VOCAB_SIZE, (37,), generator=torch.Generator().manual_seed(7))]
OTHER_PROMPTS = [PROMPT[5:18], [int(x) for x in torch.randint(3, VOCAB_SIZE, (29,),
                                                              generator=torch.Generator().manual_seed(8))]]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    return load_hf_case(request.param, family, overrides, tmp_path_factory)


def _hf_steps(hf_model, prompt: list[int], num_steps: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """HF's prefill logits [T, V], then each greedy decode step's logits [V] and the tokens chosen."""
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        prefill = out.logits[0]
        tokens, steps = [int(prefill[-1].argmax())], []
        for _ in range(num_steps):
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits[0, -1])
            tokens.append(int(steps[-1].argmax()))
    return prefill, steps, tokens


def test_prefill_and_decode_logits_match(case):
    hf_model, loaded = case
    expected_prefill, expected_steps, tokens = _hf_steps(hf_model, PROMPT, NUM_DECODE)
    harness = PagedHarness(loaded.model, num_blocks=64, block_size=4)
    table = []
    # Prefill in 3 chunks so later chunks attend over cached blocks (and across the window's edge).
    got = torch.cat([harness.all_logits(PROMPT[start:start + 13], start, table) for start in range(0, len(PROMPT), 13)])
    torch.testing.assert_close(got, expected_prefill, atol=1e-4, rtol=1e-4)
    for step, token in enumerate(tokens[:NUM_DECODE]):  # feed HF's tokens: the steps stay comparable
        got_step = harness.all_logits([token], len(PROMPT) + step, table)[0]
        torch.testing.assert_close(got_step, expected_steps[step], atol=1e-4, rtol=1e-4,
                                   msg=lambda m, step=step: f"decode step {step}: {m}")


def test_greedy_tokens_match(case):
    hf_model, loaded = case
    _, _, expected = _hf_steps(hf_model, PROMPT, NUM_DECODE - 1)
    got = PagedHarness(loaded.model, num_blocks=64, block_size=4, seed=3).generate([PROMPT], NUM_DECODE)[0]
    assert got == expected


def test_batched_equals_alone(case):
    _, loaded = case
    prompts = [PROMPT, *OTHER_PROMPTS]
    batched = PagedHarness(loaded.model, num_blocks=128, block_size=4, seed=5).generate(prompts, 12, prefill_chunk=9)
    alone = [PagedHarness(loaded.model, num_blocks=64, block_size=4, seed=6).generate([p], 12)[0] for p in prompts]
    assert batched == alone


def test_config_switches(case):
    hf_model, loaded = case
    hf, ours = hf_model.config, loaded.config
    spec = loaded.model.spec
    window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    expected_windows = [window if window and kind == "sliding_attention" else None for kind in layer_types]
    assert [ours.layer_window(i) for i in range(ours.num_hidden_layers)] == expected_windows
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    factor = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if "full_attention" in (hf.rope_parameters or {}):
        factor = 1.0
    assert ours.rotary_dim == int(head_dim * factor)
    is_gemma = hf.model_type.startswith("gemma")
    assert (spec.norm_offset, spec.post_norms, spec.embedding_scale is not None) == (
        float(is_gemma), is_gemma or hf.model_type == "glm4", is_gemma)
    assert spec.rope_layout == ("interleaved" if hf.model_type == "glm4" else "neox")
