"""Paged prefill / extend attention: causal attention for a variable-length batch whose keys and
values (cached prefix and new tokens alike) are read from the paged cache.

Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`; they are the last
`query_len` of its `seq_lens[i]` context tokens, so query row r sits at position
`seq_len - query_len + r` and sees keys 0..that position::

    keys:      [ cached prefix ............ | new tokens (the queries) ]
    query r:   sees ----------------------------------->| (its own position)

grid (num_q_tiles, num_q_heads, num_seqs): one program = BLOCK_M query rows of one head. The
key loop runs in two phases: tiles wholly at or before the tile's first query position need no
causal mask; the remaining (diagonal) tiles are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    FP8_DTYPE,
    cast,
    dot_precision,
    dot_upcast,
    fp16_operand,
    is_interpreter,
    mma,
    next_pow2,
    require,
)
from kernels.attention_ref import attention_ref, gather_context_ref
from kernels.decode_attention import _tanh
from kernels.paged_kv import check_paged_kv, paged_kv_strides

_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _prefill_tiles(
    acc,
    l_i,
    m_i,
    q,
    pos_m,  # [BLOCK_M] absolute query positions
    k_base,
    v_base,
    bt_row,
    lo,
    hi,
    first_allowed,  # [BLOCK_M] lowest key position each row may see (sliding window)
    sm_scale,
    soft_cap,
    one,
    stride_k_block,
    stride_k_tok,
    stride_v_block,
    stride_v_tok,
    offs_d,
    d_mask,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    FP16_DOTS: tl.constexpr,
):
    for n in range(lo, hi, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        if MASKED:
            n_mask = offs_n < hi
            block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        else:
            block = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        k_ptrs = k_base + (block * stride_k_block + in_page * stride_k_tok)[:, None] + offs_d[None, :]
        v_ptrs = v_base + (block * stride_v_block + in_page * stride_v_tok)[:, None] + offs_d[None, :]
        if MASKED:
            kv_mask = n_mask[:, None] & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_PREC, UPCAST)
        if USE_SOFT_CAP:
            s = (soft_cap * _LOG2E) * _tanh(s * (sm_scale / soft_cap))
        else:
            s = s * (sm_scale * _LOG2E)
        if MASKED:
            allowed = (offs_n[None, :] <= pos_m[:, None]) & n_mask[None, :]
            if USE_WINDOW:
                allowed = allowed & (offs_n[None, :] >= first_allowed[:, None])
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        if FP16_DOTS:  # fp8 V: widened before shared memory (see decode_attention.py)
            v = v.to(tl.float16) * tl.cast(one, tl.float16)
        v = v.to(q.dtype)
        acc = mma(cast(p, q.dtype), v, acc * alpha[:, None], DOT_PREC, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    sm_scale,
    soft_cap,
    v_scale,
    one,  # 1.0 (see decode_attention.py, FP16_DOTS)
    window,
    stride_q_tok,
    stride_q_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_bt_seq,
    stride_o_tok,
    stride_o_head,
    group,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    FP16_DOTS: tl.constexpr,
):
    # NOTE: the last query tiles (the longest key ranges) go first, for a shorter tail.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kv_head = head // group

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    pos_m = prefix + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if FP16_DOTS:
        q, sm_scale = fp16_operand(q, sm_scale)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    hi = tl.minimum(prefix + m0 + BLOCK_M, seq_len)  # one past the tile's last query position
    first_allowed = pos_m * 0
    if USE_WINDOW:
        first_allowed = pos_m - window + 1
        lo = tl.maximum(prefix + m0 - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _prefill_tiles(
            acc, l_i, m_i, q, pos_m, k_base, v_base, bt_row, lo, hi, first_allowed, sm_scale, soft_cap, one,
            stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, offs_d, d_mask,
            BLOCK_M, BLOCK_N, PAGE_SIZE, True, USE_WINDOW, USE_SOFT_CAP, DOT_PREC, UPCAST, FP16_DOTS,
        )  # fmt: skip
    else:
        # Keys < full_hi are visible to every row of the tile (full_hi <= its first position + 1).
        full_hi = ((prefix + m0 + 1) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _prefill_tiles(
            acc, l_i, m_i, q, pos_m, k_base, v_base, bt_row, 0, full_hi, first_allowed, sm_scale, soft_cap, one,
            stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, offs_d, d_mask,
            BLOCK_M, BLOCK_N, PAGE_SIZE, False, False, USE_SOFT_CAP, DOT_PREC, UPCAST, FP16_DOTS,
        )  # fmt: skip
        acc, l_i, m_i = _prefill_tiles(
            acc, l_i, m_i, q, pos_m, k_base, v_base, bt_row, full_hi, hi, first_allowed, sm_scale, soft_cap, one,
            stride_k_block, stride_k_tok, stride_v_block, stride_v_tok, offs_d, d_mask,
            BLOCK_M, BLOCK_N, PAGE_SIZE, True, False, USE_SOFT_CAP, DOT_PREC, UPCAST, FP16_DOTS,
        )  # fmt: skip

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc * (v_scale / l_safe)[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        cast(o, out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context in the paged cache.

    The new tokens' K/V must already be in the cache (`write_kv_cache` first). Any query length
    works (1 = decode), so a mixed prefill/decode batch is one call. `max_query_len` (a host int)
    sizes the grid; `sliding_window`, `soft_cap`, `k_scale`, `v_scale` as in
    `paged_decode_attention`. Query rows past `query_start_loc[-1]` are not written.
    """
    shape = check_paged_kv(q, k_cache, v_cache, block_tables, seq_lens, out, sliding_window=sliding_window,
                           soft_cap=soft_cap, query_start_loc=query_start_loc)
    require(max_query_len >= 0, "max_query_len must be >= 0")
    num_seqs, num_q_heads, num_kv_heads, head_dim = seq_lens.shape[0], shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    page_size, out = shape.page_size, shape.out
    if num_seqs == 0 or max_query_len == 0:
        return out

    block_d = next_pow2(head_dim)
    if is_interpreter():
        block_m = block_m or 16
        block_n = block_n or 16
        launch_opts = {}
    else:
        if q.dtype == torch.float32:  # NOTE: fp32 (FMA dot) tiles chosen to fit registers without spills
            block_m, block_n = block_m or 32, block_n or 64
            num_warps, num_stages = num_warps or 8, num_stages or 2
        else:
            # NOTE: an fp8 cache widens K and V in registers: longer key tiles amortize it (H200, 4k prompt:
            # 265 vs 236 TFLOP/s; 1k: 62 vs 56; bench/prefill_attention_tune.py)
            block_m, block_n = block_m or 64, block_n or (128 if k_cache.dtype == FP8_DTYPE else 64)
            num_warps, num_stages = num_warps or 4, num_stages or 3
        launch_opts = {"num_warps": num_warps, "num_stages": num_stages}
    require(block_m >= 16 and block_n >= 16, "block_m and block_n must be >= 16")

    grid = (triton.cdiv(max_query_len, block_m), num_q_heads, num_seqs)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        float(scale) * float(k_scale),
        float(soft_cap or 1.0),
        float(v_scale),
        1.0,
        int(sliding_window or 0),
        *paged_kv_strides(q, k_cache, v_cache, block_tables, out),
        num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=soft_cap is not None,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=dot_upcast(),
        FP16_DOTS=k_cache.dtype == FP8_DTYPE and q.dtype != torch.float32,
        **launch_opts,
    )
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain torch paged causal varlen attention in float64; returns float64 [num_tokens, Hq, D]
    (rows past `query_start_loc[-1]` are zero)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_lo, q_hi = starts[i], starts[i + 1]
        if q_hi == q_lo:
            continue
        k = gather_context_ref(k_cache, block_tables[i], seq_len, k_scale)
        v = gather_context_ref(v_cache, block_tables[i], seq_len, v_scale)
        pos = torch.arange(seq_len - (q_hi - q_lo), seq_len, device=q.device)
        out[q_lo:q_hi] = attention_ref(q[q_lo:q_hi].to(torch.float64), k, v, pos, scale, sliding_window, soft_cap)
    return out
