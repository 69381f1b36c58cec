"""The families the fused stack does not cover yet (`FamilySpec.fused_path_gaps`) run on CUDA on the
eager stack with the Triton attention backend. Here that pairing (interpreted off CUDA) against the
eager stack on the torch backend, on tiny fp32 models: Gemma 2 (attention soft caps, sliding windows,
(1 + w) norms, post-norms, GeGLU), Phi-3 (LongRoPE crossing its original length, partial rotary),
StableLM (LayerNorm) and GLM-4 (interleaved partial rotary). A prefill and decode steps must give
the same logits and the same cache contents, and a step must not sync with the host (CUDA graphs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_service.attention.backend import get_attention_backend
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig
from inference_service.model.decoder import DecoderModel
from inference_service.model.eager_stack import EagerStack
from inference_service.model.family import FamilySpec
from tests.kernels.kernel_testlib import DEVICE, rel_err
from tests.model.harness import build_metadata

COMMON = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=64, vocab_size=128, max_position_embeddings=64, rms_norm_eps=1e-6,
              tie_word_embeddings=False)
_SHORT, _LONG = [1.0 + 0.1 * i for i in range(16)], [2.0 + 0.3 * i for i in range(16)]
FAMILIES = {
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], sliding_window=8, attn_logit_softcapping=3.0,
                   final_logit_softcapping=6.0, query_pre_attn_scalar=48),
    "phi3": dict(architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.5, original_max_position_embeddings=20,
                 rope_scaling={"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}),
    "stablelm": dict(architectures=["StableLmForCausalLM"], use_qkv_bias=True),
    "glm4": dict(architectures=["Glm4ForCausalLM"]),
}
PROMPT_LENS = [19, 6]
BLOCK_SIZE, NUM_BLOCKS = 16, 8
BLOCK_TABLES = [[7, 2], [5]]


def _build(config: ModelConfig, backend: str) -> DecoderModel:
    model = DecoderModel(config, device=DEVICE, fused_kernels=False,
                         attention_backend=get_attention_backend(DEVICE, backend))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = torch.randn(param.shape, generator=gen)
            param.copy_((0.2 * values + (0.0 if "gemma" in config.model_type else 1.0))
                        if name.endswith("norm.weight") else 0.15 * values)
    model.finish_loading()
    return model


def _to_device(metadata):
    return dataclasses.replace(metadata, **{f.name: getattr(metadata, f.name).to(DEVICE)
                                            for f in dataclasses.fields(metadata)
                                            if isinstance(getattr(metadata, f.name), torch.Tensor)})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_eager_stack_on_triton_attention_matches_torch(family):
    config = ModelConfig.from_hf_dict({**COMMON, **FAMILIES[family]})
    assert FamilySpec.from_config(config).fused_path_gaps(config)  # a family the fused stack lacks
    models = {name: _build(config, name) for name in ("torch", "triton")}
    assert all(type(m.stack) is EagerStack for m in models.values())
    caches = {name: [tuple(torch.zeros(m.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE), device=DEVICE) for _ in range(2))
                     for _ in range(config.num_hidden_layers)] for name, m in models.items()}
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    cached = [0, 0]
    for _ in range(4):  # prefill, then decode steps: Phi-3's first sequence crosses its original 20
        metadata = _to_device(build_metadata(cached, [len(t) for t in tokens], BLOCK_TABLES, BLOCK_SIZE))
        input_ids = torch.tensor([t for seq in tokens for t in seq], device=DEVICE)
        positions = torch.tensor([p for c, seq in zip(cached, tokens) for p in range(c, c + len(seq))], device=DEVICE)
        last_rows = torch.tensor(metadata.query_start_loc_cpu[1:], device=DEVICE) - 1
        logits = {name: m.compute_logits(m(input_ids, positions, caches[name], metadata).index_select(0, last_rows))
                  for name, m in models.items()}
        assert rel_err(logits["triton"], logits["torch"]) < 1e-5
        for (k, v), (ref_k, ref_v) in zip(caches["triton"], caches["torch"]):
            assert rel_err(k, ref_k) < 1e-5 and rel_err(v, ref_v) < 1e-5
        greedy = logits["torch"].argmax(-1).tolist()
        assert logits["triton"].argmax(-1).tolist() == greedy
        cached = [c + len(seq) for c, seq in zip(cached, tokens)]
        tokens = [[t] for t in greedy]


def test_long_rope_choice_is_per_sequence_without_host_sync():
    """LongRoPE picks the long factors per sequence, by its context length; the flag is computed on
    the device (no `repeat_interleave` with a host-side size), padding rows included."""
    config = ModelConfig.from_hf_dict({**COMMON, **FAMILIES["phi3"]})
    stack = _build(config, "torch").stack
    metadata = build_metadata([18, 0, 30], [3, 2, 1], [[1, 2], [3], [4, 5]], BLOCK_SIZE)
    positions = torch.zeros(8, dtype=torch.int64)  # 6 real rows, 2 padding rows
    flags = stack._uses_long_rope(positions, metadata)
    assert flags.tolist() == [True, True, True, False, False, True, True, True]


def test_explicit_fused_request_still_refuses_the_gaps():
    config = ModelConfig.from_hf_dict({**COMMON, **FAMILIES["stablelm"]})
    with pytest.raises(UnsupportedModelError, match="StableLmForCausalLM needs LayerNorm, partial rotary"):
        DecoderModel(config, device=DEVICE, fused_kernels=True)
