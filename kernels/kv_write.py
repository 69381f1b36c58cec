"""KV write: scatter each new token's K and V into the paged cache at its slot.

`slot = block * block_size + offset`; slot -1 marks padding and is skipped. With an fp8 (e4m3)
cache the values are divided by the layer's scale, saturated to +-448 and rounded to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    CACHE_DTYPES,
    FP8_DTYPE,
    FP8_MAX,
    is_interpreter,
    next_pow2,
    pdl_args,
    pdl_enter,
    require,
    require_dtype,
    require_inner_contiguous,
    require_same_device,
    require_shape,
)


@triton.jit
def _round_to_e4m3(x):
    """x (fp32, already within +-448) rounded to the nearest e4m3 value, ties to even, in fp32.

    NOTE: only for the interpreter, whose fp32 -> fp8 cast drops the carry out of the mantissa
    (31.6 -> 16). Exact: a power-of-two quantum per value and the 1.5 * 2**23 rounding trick."""
    bits = x.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    q_exp = tl.maximum(exp - 3, 127 - 9)  # 3 mantissa bits; subnormal quantum 2**-9
    quantum = (q_exp << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((254 - q_exp) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(x) * inv_quantum + 12582912.0) - 12582912.0) * quantum
    return tl.where(bits < 0, -r, r)  # the sign bit, so that -0.0001 stays -0.0 as in torch


@triton.jit
def _store_row(
    src_ptr,
    dst_ptr,
    token,
    slot,
    scale,
    stride_src_tok,
    stride_src_head,
    stride_dst_block,
    stride_dst_tok,
    stride_dst_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_HD)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    mask = (offs < NUM_HEADS * HEAD_DIM) & ((offs * 0 + slot) >= 0)
    x = tl.load(src_ptr + token * stride_src_tok + head * stride_src_head + dim, mask=mask, other=0.0)
    block = slot // PAGE_SIZE
    in_page = slot % PAGE_SIZE
    dst = dst_ptr + block * stride_dst_block + in_page * stride_dst_tok + head * stride_dst_head + dim
    tl.store(dst, quantize_row(x, scale, QUANT, EXACT_ROUND).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_row(x, scale, QUANT: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """x as the cache stores it, before the cast to its dtype: with QUANT (an e4m3 cache) x / scale saturated
    to +-448 (rounded to e4m3 here when EXACT_ROUND, the interpreter), else x."""
    if QUANT:
        y = tl.math.div_rn(x.to(tl.float32), scale)  # IEEE division (`/` may be approximate)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if EXACT_ROUND:
            y = _round_to_e4m3(y)
        return y
    else:
        return x


@triton.jit
def _kv_write_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    k_scale,
    v_scale,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_block,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_block,
    stride_vc_tok,
    stride_vc_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    _store_row(k_ptr, k_cache_ptr, token, slot, k_scale, stride_k_tok, stride_k_head,
               stride_kc_block, stride_kc_tok, stride_kc_head,
               NUM_HEADS, HEAD_DIM, BLOCK_HD, PAGE_SIZE, QUANT, EXACT_ROUND)  # fmt: skip
    _store_row(v_ptr, v_cache_ptr, token, slot, v_scale, stride_v_tok, stride_v_head,
               stride_vc_block, stride_vc_tok, stride_vc_head,
               NUM_HEADS, HEAD_DIM, BLOCK_HD, PAGE_SIZE, QUANT, EXACT_ROUND)  # fmt: skip


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32); -1 = skip
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token t's K/V to cache slot `slot_mapping[t]` (skipping -1), in place.

    The cache dtype is k's or fp8 e4m3; for fp8 the stored value is k / k_scale (v / v_scale)
    saturated to +-448 and rounded to nearest even. Slots must be distinct and < num_blocks * block_size.
    """
    require(k.dim() == 3, lambda: f"k: expected [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    require_shape("v", v, tuple(k.shape))
    require(k_cache.dim() == 4, lambda: f"k_cache: expected 4 dims, got {tuple(k_cache.shape)}")
    require_shape("k_cache", k_cache, (k_cache.shape[0], k_cache.shape[1], num_kv_heads, head_dim))
    require_shape("v_cache", v_cache, tuple(k_cache.shape))
    require_shape("slot_mapping", slot_mapping, (num_tokens,))
    require_dtype("k", k, ACT_DTYPES)
    require(v.dtype == k.dtype, "k and v dtypes differ")
    require_dtype("k_cache", k_cache, CACHE_DTYPES)
    require(v_cache.dtype == k_cache.dtype, "k_cache and v_cache dtypes differ")
    quant = k_cache.dtype == FP8_DTYPE
    require(quant or k_cache.dtype == k.dtype, lambda: f"k_cache dtype {k_cache.dtype} must be k's ({k.dtype}) or fp8")
    require(k_scale > 0 and v_scale > 0, "k_scale and v_scale must be positive")
    require_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_inner_contiguous(name, t)
    require_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HD=next_pow2(num_kv_heads * head_dim),
        PAGE_SIZE=k_cache.shape[1],
        QUANT=quant,
        EXACT_ROUND=quant and is_interpreter(),
        **pdl_args(k.device),
    )


def quantize_fp8_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale saturated to the e4m3 range and cast (torch rounds to nearest even)."""
    x = x.to(torch.float32)
    # NOTE: a tensor divisor: torch divides by a Python scalar through its reciprocal (not IEEE).
    return (x / torch.full_like(x, scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def write_kv_cache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain torch version of `write_kv_cache`, in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for src, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        value = quantize_fp8_ref(src, scale) if cache.dtype == FP8_DTYPE else src.to(cache.dtype)
        page_size = cache.shape[1]
        cache[slots // page_size, slots % page_size] = value  # either layout (token- or head-major)
