"""Rotary embedding (neox and gpt-j) against the float64 reference and Hugging Face's rope."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_testlib import DEVICE, DTYPE_IDS, ON_GPU, TOL, rel_err

from inference_service.model.rope import build_cos_sin_cache
from kernels import apply_rotary, rotary_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
GRID = list(itertools.product((64, 80, 128), (True, False), (F32, F16, BF16)))
if not ON_GPU:
    GRID = [g for g in GRID if g[2] != F16] + [(128, True, F16)]

ROPE_KINDS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}  # fmt: skip


def run_case(head_dim, is_neox, dtype, *, rotary_dim=None, num_tokens=7, num_q_heads=4, num_kv_heads=2,
             with_k=True, strided=True):  # fmt: skip
    rotary_dim = rotary_dim or head_dim
    cache = build_cos_sin_cache(rotary_dim, 4096, 10000.0, device=DEVICE)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, device=DEVICE).to(dtype)
    if strided:  # rotate views of the fused qkv output in place
        q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
        k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    else:
        q = qkv[:, : num_q_heads * head_dim].reshape(num_tokens, num_q_heads, head_dim).clone()
        k = torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    v_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].clone()
    q_ref, k_ref = rotary_ref(q, positions, cache, is_neox=is_neox), rotary_ref(k, positions, cache, is_neox=is_neox)
    k_before = k.clone()
    apply_rotary(q, k if with_k else None, positions, cache, is_neox=is_neox)
    assert rel_err(q, q_ref) <= TOL[dtype]
    if with_k:
        assert rel_err(k, k_ref) <= TOL[dtype]
    else:
        assert torch.equal(k, k_before)
    if strided:
        assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], v_before)  # v untouched
    # dims past rotary_dim are passed through bit for bit
    assert torch.equal(q[..., rotary_dim:], q_ref[..., rotary_dim:].to(dtype))


@pytest.mark.parametrize("head_dim,is_neox,dtype", GRID,
                         ids=[f"d{d}-{'neox' if n else 'gptj'}-{DTYPE_IDS[t]}" for d, n, t in GRID])  # fmt: skip
def test_rotary(head_dim, is_neox, dtype):
    run_case(head_dim, is_neox, dtype, num_tokens=64 if ON_GPU else 7)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_partial_dim_q_only_and_gqa(is_neox):
    run_case(64, is_neox, F32, rotary_dim=32, num_q_heads=3, num_kv_heads=1, with_k=False, strided=False)
    run_case(80, is_neox, BF16, rotary_dim=40, num_q_heads=8, num_kv_heads=1)


@pytest.mark.parametrize("kind", list(ROPE_KINDS))
def test_cos_sin_cache_and_rotation_match_hugging_face(kind):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    head_dim, base, max_pos = 64, 500000.0, 131072
    params = dict(ROPE_KINDS[kind] or {"rope_type": "default"}, rope_theta=base)
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_parameters=params)  # fmt: skip
    positions = torch.tensor([0, 1, 17, 4095, 8191, 30000, 100000])
    q = torch.randn(1, 4, len(positions), head_dim)
    k = torch.randn(1, 2, len(positions), head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)

    cache = build_cos_sin_cache(head_dim, 100001, base, ROPE_KINDS[kind], max_position_embeddings=max_pos)
    assert torch.equal(cache[positions, : head_dim // 2], cos[0, :, : head_dim // 2])
    assert torch.equal(cache[positions, head_dim // 2 :], sin[0, :, : head_dim // 2])
    q_ours = q[0].transpose(0, 1).contiguous().to(DEVICE)  # [tokens, heads, head_dim]
    k_ours = k[0].transpose(0, 1).contiguous().to(DEVICE)
    apply_rotary(q_ours, k_ours, positions.to(DEVICE), cache.to(DEVICE), is_neox=True)
    assert rel_err(q_ours.cpu(), q_hf[0].transpose(0, 1).double()) <= TOL[F32]
    assert rel_err(k_ours.cpu(), k_hf[0].transpose(0, 1).double()) <= TOL[F32]


def test_rotary_checks_arguments():
    q = torch.randn(3, 2, 64, device=DEVICE)
    cache = build_cos_sin_cache(64, 16, 10000.0, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(q, None, torch.zeros(2, dtype=torch.int64, device=DEVICE), cache)
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary(q, None, torch.zeros(3, dtype=torch.int64, device=DEVICE), build_cos_sin_cache(128, 16, 1e4, device=DEVICE))
    with pytest.raises(ValueError, match="rope_type"):
        build_cos_sin_cache(64, 16, 1e4, {"rope_type": "longrope"})


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_qk_norm_folded_into_the_rotary_equals_norm_then_rotary(is_neox, dtype):
    """Qwen3's QK-norm in the rotary launch, on views of the fused projection: each head RMS-normalized with its
    weight, rounded to the activation dtype, then rotated; v untouched."""
    from kernels import rms_norm, rms_norm_ref

    num_tokens, num_q_heads, num_kv_heads, head_dim, eps = 5, 4, 2, 64, 1e-6
    gen = torch.Generator().manual_seed(11)
    cache = build_cos_sin_cache(head_dim, 4096, 10000.0, device=DEVICE)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(DEVICE)
    qkv = (torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3).to(DEVICE, dtype)
    q_w, k_w = (torch.rand(head_dim, generator=gen) + 0.5).to(DEVICE, dtype), torch.rand(head_dim, generator=gen).to(DEVICE, dtype)
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    # the unfused kernels' way: copies of q and k normed, then rotated
    q_sep = qkv[:, :q_end].reshape(-1, head_dim).clone()
    k_sep = qkv[:, q_end:k_end].reshape(-1, head_dim).clone()
    q_ref = rotary_ref(rms_norm_ref(q_sep, q_w, eps)[0].to(dtype).view(num_tokens, num_q_heads, head_dim), positions,
                       cache, is_neox=is_neox)
    k_ref = rotary_ref(rms_norm_ref(k_sep, k_w, eps)[0].to(dtype).view(num_tokens, num_kv_heads, head_dim), positions,
                       cache, is_neox=is_neox)
    rms_norm(q_sep, q_w, eps, out=q_sep)
    rms_norm(k_sep, k_w, eps, out=k_sep)
    q_sep, k_sep = q_sep.view(num_tokens, num_q_heads, head_dim), k_sep.view(num_tokens, num_kv_heads, head_dim)
    apply_rotary(q_sep, k_sep, positions, cache, is_neox=is_neox)

    v_before = qkv[:, k_end:].clone()
    q = qkv[:, :q_end].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim)
    apply_rotary(q, k, positions, cache, is_neox=is_neox, q_norm_weight=q_w, k_norm_weight=k_w, norm_eps=eps)
    assert rel_err(q, q_ref) <= TOL[dtype] and rel_err(k, k_ref) <= TOL[dtype]
    torch.testing.assert_close(q, q_sep, rtol=1e-5 if dtype == F32 else 1.6e-2, atol=1e-5 if dtype == F32 else 1e-2)
    torch.testing.assert_close(k, k_sep, rtol=1e-5 if dtype == F32 else 1.6e-2, atol=1e-5 if dtype == F32 else 1e-2)
    assert torch.equal(qkv[:, k_end:], v_before)
    with pytest.raises(ValueError, match="QK-norm needs q, k and both weights"):
        apply_rotary(q, k, positions, cache, q_norm_weight=q_w)
    with pytest.raises(ValueError, match="rotary_dim == head_dim"):
        apply_rotary(q, k, positions, cache[:, :32].contiguous(), q_norm_weight=q_w, k_norm_weight=k_w)
