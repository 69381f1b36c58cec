"""What a decode step does before attending, done inside the decode attention kernel (`append=`).

Unfused, each layer of a decode step launches three kernels in a row, the first two of one program a
token doing almost nothing (a batch-1 step: one CTA each, ~3-5 us of latency a launch, H100 profile):

    apply_rotary(q, k)                 QK-norm (Qwen3) and the rotary, in place
    write_kv_cache(k, v -> slot)       the new token's K/V into the paged cache
    paged_decode_attention(q, ...)

With a `DecodeAppend`, each decode program rotates its own query heads in registers, and the program
holding the split that ends at the new token (the only one that reads that position) rotates the new
K, writes K and V to the cache (quantized as `write_kv_cache` does) and then attends as usual. Values
are rounded to the activation dtype where the unfused kernels store them, so the cache and the output
equal the three launches'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import ACT_DTYPES, FP8_DTYPE, cast, is_interpreter, require, require_dtype, require_shape
from kernels.kv_write import quantize_row
from kernels.rotary import Rotary


@dataclass(frozen=True)
class DecodeAppend:
    """A decode step's new token a sequence, for the decode kernel to write into the cache before attending.

    `k` is un-rotated when `rotary` is given (q too: the kernel rotates both)."""

    k: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_seqs, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_seqs] int64 or int32, -1 = padding (not written)
    rotary: Rotary | None = None  # over the whole head, neox pairs


def append_launch_args(append: DecodeAppend | None, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[tuple, dict]:
    """(pointer and scalar arguments, constexprs) of the decode kernel's prologue; placeholders without one."""
    if append is None:
        return (q, q, q, q, q, q, q, 1e-6, 0, 0, 0, 0, 0), {"APPEND": False, "ROPE": False, "QK_NORM": False,
                                                             "QUANT_STORE": False, "EXACT_ROUND": False}
    num_seqs, num_kv_heads, head_dim = q.shape[0], k_cache.shape[2], q.shape[2]
    for name, t in (("append.k", append.k), ("append.v", append.v)):
        require_shape(name, t, (num_seqs, num_kv_heads, head_dim))
        require(t.dtype == q.dtype and t.stride(2) == 1, lambda name=name: f"{name}: q's dtype, last dim contiguous")
    require_shape("append.slot_mapping", append.slot_mapping, (num_seqs,))
    require_dtype("append.slot_mapping", append.slot_mapping, (torch.int64, torch.int32))
    rotary = append.rotary
    has_norm = rotary is not None and rotary.q_norm_weight is not None
    if rotary is not None:
        require_shape("rotary.positions", rotary.positions, (num_seqs,))
        require_dtype("rotary.positions", rotary.positions, (torch.int64, torch.int32))
        table = rotary.cos_sin_cache
        require(table.dim() == 2 and table.shape[1] == head_dim and table.stride(1) == 1,
                lambda: f"rotary.cos_sin_cache: expected [max_position, {head_dim}] (a rotary over the whole head), "
                        f"got {tuple(table.shape)}")
        require_dtype("rotary.cos_sin_cache", table, ACT_DTYPES)
        require(has_norm == (rotary.k_norm_weight is not None), "QK-norm needs both q_norm_weight and k_norm_weight")
        if has_norm:
            for name, w in (("q_norm_weight", rotary.q_norm_weight), ("k_norm_weight", rotary.k_norm_weight)):
                require(w.shape == (head_dim,) and w.is_contiguous(),
                        lambda name=name, w=w: f"{name}: shape {tuple(w.shape)}")
            require(rotary.norm_eps > 0, "norm_eps must be positive")
    args = (
        append.k,
        append.v,
        append.slot_mapping,
        rotary.positions if rotary is not None else append.slot_mapping,
        rotary.cos_sin_cache if rotary is not None else q,
        rotary.q_norm_weight if has_norm else q,
        rotary.k_norm_weight if has_norm else q,
        float(rotary.norm_eps) if has_norm else 1e-6,
        append.k.stride(0),
        append.k.stride(1),
        append.v.stride(0),
        append.v.stride(1),
        rotary.cos_sin_cache.stride(0) if rotary is not None else 0,
    )
    quant = k_cache.dtype == FP8_DTYPE
    return args, {"APPEND": True, "ROPE": rotary is not None, "QK_NORM": has_norm, "QUANT_STORE": quant,
                  "EXACT_ROUND": quant and is_interpreter()}


@triton.jit
def rope_rows(row_ptrs, offs_d, mask, cos_sin_row, norm_ptr, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
              DTYPE: tl.constexpr):
    """Rows at `row_ptrs` [R, 1] (pointers to each head's dim 0), RMS-normed (HAS_NORM) and rotated, in fp32
    [R, BLOCK_D]: neox pairs (d, d + HEAD_DIM / 2), the normed values rounded to DTYPE as the norm stores them."""
    HALF: tl.constexpr = HEAD_DIM // 2
    is_first = offs_d < HALF
    partner = tl.where(is_first, offs_d + HALF, offs_d - HALF)
    x = tl.load(row_ptrs + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_pair = tl.load(row_ptrs + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    d_mask = offs_d < HEAD_DIM
    if HAS_NORM:
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)  # [R]
        w = tl.load(norm_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        w_pair = tl.load(norm_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
        x = cast(x * inv_rms[:, None] * w[None, :], DTYPE).to(tl.float32)
        x_pair = cast(x_pair * inv_rms[:, None] * w_pair[None, :], DTYPE).to(tl.float32)
    i = tl.where(is_first, offs_d, offs_d - HALF)
    cos = tl.load(cos_sin_row + i, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_row + HALF + i, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return tl.where(is_first[None, :], x * cos - x_pair * sin, x * cos + x_pair * sin)


@triton.jit
def load_query(q_ptrs, offs_d, mask, seq, positions_ptr, cos_sin_ptr, stride_cs, norm_ptr, eps,
               HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr, DTYPE: tl.constexpr):
    """The query tile [R, BLOCK_D] in DTYPE, rotated first when ROPE (as `apply_rotary` would have stored it)."""
    if ROPE:
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq).to(tl.int64) * stride_cs
        q = cast(rope_rows(q_ptrs, offs_d, mask, cos_sin_row, norm_ptr, eps, HEAD_DIM, QK_NORM, DTYPE), DTYPE)
    else:
        q = tl.load(q_ptrs + offs_d[None, :], mask=mask, other=0.0)
    return q


@triton.jit
def append_token(seq, kv_head, new_k_ptr, new_v_ptr, slot_mapping_ptr, positions_ptr, cos_sin_ptr, k_norm_ptr, eps,
                 stride_nk_seq, stride_nk_head, stride_nv_seq, stride_nv_head, stride_cs,
                 k_cache_ptr, v_cache_ptr, stride_k_block, stride_k_tok, stride_k_head, stride_v_block, stride_v_tok,
                 stride_v_head, k_scale, v_scale, offs_d,
                 HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr,
                 QUANT: tl.constexpr, EXACT_ROUND: tl.constexpr, DTYPE: tl.constexpr):
    """Writes the sequence's new K (rotated when ROPE) and V of one KV head into the cache at its slot, then
    syncs the program's threads, so that its own loads of that position see them."""
    slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
    if slot >= 0:
        mask = (offs_d < HEAD_DIM)[None, :]
        k_row = (new_k_ptr + seq.to(tl.int64) * stride_nk_seq + kv_head * stride_nk_head + tl.zeros([1, 1], tl.int64))
        v_row = (new_v_ptr + seq.to(tl.int64) * stride_nv_seq + kv_head * stride_nv_head + tl.zeros([1, 1], tl.int64))
        if ROPE:
            cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + seq).to(tl.int64) * stride_cs
            k = cast(rope_rows(k_row, offs_d, mask, cos_sin_row, k_norm_ptr, eps, HEAD_DIM, QK_NORM, DTYPE), DTYPE)
        else:
            k = tl.load(k_row + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_row + offs_d[None, :], mask=mask, other=0.0)
        block, in_page = slot // PAGE_SIZE, slot % PAGE_SIZE
        k_dst = k_cache_ptr + block * stride_k_block + in_page * stride_k_tok + kv_head * stride_k_head
        v_dst = v_cache_ptr + block * stride_v_block + in_page * stride_v_tok + kv_head * stride_v_head
        tl.store(k_dst + offs_d[None, :], quantize_row(k, k_scale, QUANT, EXACT_ROUND).to(k_cache_ptr.dtype.element_ty),
                 mask=mask)
        tl.store(v_dst + offs_d[None, :], quantize_row(v, v_scale, QUANT, EXACT_ROUND).to(v_cache_ptr.dtype.element_ty),
                 mask=mask)
    tl.debug_barrier()
