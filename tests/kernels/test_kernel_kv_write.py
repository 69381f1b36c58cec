"""KV write by slot_mapping against its reference: written slots exact, all others untouched."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_testlib import DEVICE, DTYPE_IDS, ON_GPU, poisoned

from kernels import FP8_DTYPE, quantize_fp8_ref, write_kv_cache, write_kv_cache_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN slots included)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def run_case(num_tokens, num_kv_heads, head_dim, page, dtype, cache_dtype, *, num_skipped=2, int32_slots=False,
             strided=False, k_scale=1.0, v_scale=1.0, magnitude=1.0):  # fmt: skip
    num_blocks = -(-num_tokens // page) + 2
    if strided:  # k and v as views of a fused qkv projection output
        qkv = torch.randn(num_tokens, (4 + 2) * num_kv_heads * head_dim, device=DEVICE).to(dtype)
        k = qkv[:, 4 * num_kv_heads * head_dim : 5 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, 5 * num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    else:
        k = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE) * magnitude).to(dtype)
        v = (torch.randn(num_tokens, num_kv_heads, head_dim, device=DEVICE) * magnitude).to(dtype)
    slots = torch.randperm(num_blocks * page, device=DEVICE)[:num_tokens]
    slots[torch.randperm(num_tokens, device=DEVICE)[:num_skipped]] = -1
    slots = slots.to(torch.int32 if int32_slots else torch.int64)
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache, v_cache = poisoned(shape, cache_dtype), poisoned(shape, cache_dtype)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    write_kv_cache_ref(k, v, k_exp, v_exp, slots, k_scale=k_scale, v_scale=v_scale)
    assert same(k_cache, k_exp) and same(v_cache, v_exp)


GRID = list(itertools.product((64, 80, 128), (1, 3, 8), (16, 32), (F32, F16, BF16)))
if not ON_GPU:
    GRID = [(64, 1, 16, F32), (80, 3, 32, BF16), (128, 8, 16, F16)]


@pytest.mark.parametrize("head_dim,num_kv_heads,page,dtype", GRID,
                         ids=[f"d{d}-h{h}-p{p}-{DTYPE_IDS[t]}" for d, h, p, t in GRID])  # fmt: skip
def test_kv_write_grid(head_dim, num_kv_heads, page, dtype):
    num_tokens = 300 if ON_GPU else 21
    run_case(num_tokens, num_kv_heads, head_dim, page, dtype, dtype)
    run_case(num_tokens, num_kv_heads, head_dim, page, dtype, FP8_DTYPE, k_scale=0.02, v_scale=0.05)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kv_write_strided_and_int32_slots(dtype):
    run_case(9, 2, 64, 16, dtype, dtype, strided=True, int32_slots=True)


def test_kv_write_all_skipped_and_empty():
    run_case(5, 1, 64, 16, F32, F32, num_skipped=5)  # only -1 slots: nothing written
    run_case(0, 1, 64, 16, F32, F32, num_skipped=0)  # no tokens


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kv_write_fp8_saturates_and_rounds_like_torch(dtype):
    # values far past 448 * scale saturate; the rest round to nearest even exactly as torch casts
    run_case(40, 2, 64, 16, dtype, FP8_DTYPE, k_scale=0.01, v_scale=0.5, magnitude=20.0)


def test_fp8_quantization_error_is_bounded():
    x = torch.randn(4096, device=DEVICE)
    scale = x.abs().max().item() / 448
    err = ((quantize_fp8_ref(x, scale).float() * scale - x).norm() / x.norm()).item()
    assert err < 0.04, err  # 3 mantissa bits


def test_kv_write_checks_arguments():
    k = torch.randn(3, 2, 64, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, cache, cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, cache, cache.clone(), slots.float())
    with pytest.raises(ValueError, match="k_cache"):
        write_kv_cache(k, k, cache.to(BF16), cache.to(BF16), slots)
    with pytest.raises(ValueError, match="k_cache"):
        write_kv_cache(k, k, cache[..., :32], cache[..., :32], slots)
