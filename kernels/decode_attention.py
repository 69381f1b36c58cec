"""Paged decode attention: one query token per sequence over its paged K/V.

Split-KV, grid (num_seqs, num_kv_heads, num_splits): one program = one sequence x one KV head x
one slice of the context (`kernels/split_kv.py` divides it). It serves every query head of the KV
head's group at once (a [BLOCK_H, D] query tile), so each K/V tile is read from memory once per
group, and writes a partial output plus its log-sum-exp; `split_kv.merge_splits` then combines the
partials. With num_splits == 1 the program writes the final output and there is no merge.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import (
    FP8_DTYPE,
    cast,
    dot_precision,
    dot_upcast,
    fp16_operand,
    is_hopper_or_later,
    is_interpreter,
    mma,
    next_pow2,
    num_sms,
    pdl_args,
    pdl_enter,
    require,
)
from kernels.decode_prologue import DecodeAppend, append_launch_args, append_token, load_query
from kernels.paged_kv import check_paged_kv, paged_kv_strides
from kernels.split_kv import MAX_KV_SPLITS, choose_num_kv_splits, merge_splits, split_bounds

_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _tanh(x):
    # NOTE: written through the sigmoid so that it runs the same in the interpreter and on the GPU.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _load_kv_tile(bt_row, first_blocks, k_base, v_base, n, lo, hi, first, stride_k_block, stride_k_tok,
                  stride_v_block, stride_v_tok, offs_d, d_mask, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  USE_WINDOW: tl.constexpr):
    """K and V of context tokens [n, n + BLOCK_N), as stored ([BLOCK_N, BLOCK_D] each), and which are visible.
    The split's first tile (n == lo) takes its page numbers from `first_blocks` ([BLOCK_N], read earlier)."""
    offs_n = n + tl.arange(0, BLOCK_N)
    valid = offs_n < hi
    if USE_WINDOW:
        valid = valid & (offs_n >= first)
    in_first = offs_n < lo + BLOCK_N
    block = tl.load(bt_row + offs_n // PAGE_SIZE, mask=valid & ~in_first, other=0)
    block = tl.where(in_first, first_blocks, block).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_base + (block * stride_k_block + in_page * stride_k_tok)[:, None] + offs_d[None, :], mask=kv_mask,
                other=0.0)
    v = tl.load(v_base + (block * stride_v_block + in_page * stride_v_tok)[:, None] + offs_d[None, :], mask=kv_mask,
                other=0.0)
    return k, v, valid


# NOTE: the split count is a run-time argument (not specialized) so that one compiled kernel serves every count:
# mixed steps choose theirs from their own decode rows, and each new count compiled mid-serving took ~1.4 s
# (five compiles in an H100's first offline run: mixed steps 23.6 s against 16.4 once compiled).
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,  # [num_seqs, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_q_heads, head_dim]          (not SPLIT)
    part_o_ptr,  # [num_seqs, num_q_heads, num_splits, head_dim] fp32 (SPLIT)
    part_lse_ptr,  # [num_seqs, num_q_heads, num_splits] fp32, log2 domain
    sm_scale,  # softmax scale times the K dequant scale
    soft_cap,
    v_scale,
    one,  # 1.0 (see FP16_DOTS below)
    window,
    num_splits,  # 1 unless SPLIT
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_tok,
    stride_k_head,
    stride_v_block,
    stride_v_tok,
    stride_v_head,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    group,  # query heads per KV head
    new_k_ptr,  # [num_seqs, num_kv_heads, head_dim] (APPEND: decode_prologue.py)
    new_v_ptr,
    slot_mapping_ptr,  # [num_seqs]
    positions_ptr,  # [num_seqs] (ROPE)
    cos_sin_ptr,  # [max_position, head_dim]
    q_norm_ptr,  # [head_dim] (QK_NORM)
    k_norm_ptr,
    norm_eps,
    stride_nk_seq,
    stride_nk_head,
    stride_nv_seq,
    stride_nv_head,
    stride_cs,
    k_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: partials for the merge
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    APPEND: tl.constexpr,
    ROPE: tl.constexpr,
    QK_NORM: tl.constexpr,
    QUANT_STORE: tl.constexpr,
    EXACT_ROUND: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # NOTE: the context's length and its pages come from the host, not from the previous kernel: read
    # before the PDL wait (with the first tile's page numbers), they are at hand when the query is.
    seq_len = tl.load(seq_lens_ptr + seq)
    first, lo, hi, num_active = split_bounds(seq_len, window, split, num_splits, BLOCK_N, USE_WINDOW)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    first_tile = lo + tl.arange(0, BLOCK_N)
    first_blocks = tl.load(bt_row + first_tile // PAGE_SIZE, mask=first_tile < hi, other=0)
    pdl_enter(USE_PDL)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * group + offs_h
    h_mask = offs_h < group
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = load_query(q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head, offs_d,
                   h_mask[:, None] & d_mask[None, :], seq, positions_ptr, cos_sin_ptr, stride_cs, q_norm_ptr, norm_eps,
                   HEAD_DIM, ROPE, QK_NORM, q_ptr.dtype.element_ty)  # [BLOCK_H, BLOCK_D]
    if FP16_DOTS:
        q, sm_scale = fp16_operand(q, sm_scale)

    k_base = k_cache_ptr + kv_head * stride_k_head
    v_base = v_cache_ptr + kv_head * stride_v_head
    if APPEND:
        if split == num_active - 1:  # the split ending at the new token: the only one reading its position
            append_token(seq, kv_head, new_k_ptr, new_v_ptr, slot_mapping_ptr, positions_ptr, cos_sin_ptr, k_norm_ptr,
                         norm_eps, stride_nk_seq, stride_nk_head, stride_nv_seq, stride_nv_head, stride_cs,
                         k_cache_ptr, v_cache_ptr, stride_k_block, stride_k_tok, stride_k_head, stride_v_block,
                         stride_v_tok, stride_v_head, k_scale, v_scale, offs_d, HEAD_DIM, PAGE_SIZE, ROPE, QK_NORM,
                         QUANT_STORE, EXACT_ROUND, q_ptr.dtype.element_ty)

    # NOTE: a finite floor for the running max keeps exp2(m_old - m_new) defined when a tile is
    # fully masked; masked scores are -inf and contribute exactly 0.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    for n in range(lo, hi, BLOCK_N):
        k, v, valid = _load_kv_tile(bt_row, first_blocks, k_base, v_base, n, lo, hi, first, stride_k_block,
                                    stride_k_tok, stride_v_block, stride_v_tok, offs_d, d_mask, BLOCK_N, PAGE_SIZE,
                                    USE_WINDOW)
        k = k.to(q.dtype)
        s = mma(q, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT_PREC, UPCAST)  # [BLOCK_H, BLOCK_N]
        if USE_SOFT_CAP:
            s = (soft_cap * _LOG2E) * _tanh(s * (sm_scale / soft_cap))
        else:
            s = s * (sm_scale * _LOG2E)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP16_DOTS:
            # NOTE: a product with a run-time 1.0 keeps the compiler from moving the widening after
            # shared memory, where fp8 V, read transposed, is fetched byte by byte (64 LDS.U8 a tile).
            v = v.to(tl.float16) * tl.cast(one, tl.float16)
        v = v.to(q.dtype)
        acc = mma(cast(p, q.dtype), v, acc * alpha[:, None], DOT_PREC, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    hd_mask = h_mask[:, None] & d_mask[None, :]
    if not SPLIT:
        o = o * v_scale
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :],
            cast(o, out_ptr.dtype.element_ty),
            mask=hd_mask,
        )
    elif split < num_active:
        po = part_o_ptr + seq.to(tl.int64) * stride_po_seq + split * stride_po_split
        tl.store(po + heads[:, None] * stride_po_head + offs_d[None, :], o, mask=hd_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + heads * stride_pl_head + split, lse, mask=h_mask)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [num_seqs, num_q_heads, head_dim]
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    append: DecodeAppend | None = None,
) -> torch.Tensor:
    """Attention of each sequence's single query token over its whole paged context.

    Query head h reads KV head h // (num_q_heads // num_kv_heads). Keys are `seq_lens[i]` tokens,
    the query being the last of them (its K/V must already be in the cache). `sliding_window=W`
    keeps the last W keys; a sequence with seq_len 0 (batch padding) gets zeros; `soft_cap=c` maps scores s to c * tanh(s / c) (Gemma 2). With an fp8
    (e4m3) cache, stored values are multiplied by `k_scale` / `v_scale`.

    `num_kv_splits` (a power of two <= 64) defaults to `choose_num_kv_splits(...)`, which needs
    `max_seq_len`; without either the launcher reads `seq_lens.max()` (a device sync: pass one of
    them under CUDA-graph capture). `block_n`, `num_warps`, `num_stages` override the tile config.

    `append` (`kernels/decode_prologue.py`): the step's new K/V, one token a sequence, not yet in the cache; the
    kernel writes them at `append.slot_mapping` before attending, and with `append.rotary` first rotates q and
    the new k (and QK-norms them), as `apply_rotary` and `write_kv_cache` would have.
    """
    shape = check_paged_kv(q, k_cache, v_cache, block_tables, seq_lens, out, sliding_window=sliding_window,
                           soft_cap=soft_cap, num_seqs=q.shape[0])
    num_seqs, num_q_heads, num_kv_heads, head_dim = q.shape[0], shape.num_q_heads, shape.num_kv_heads, shape.head_dim
    page_size, out = shape.page_size, shape.out
    if num_seqs == 0:
        return out

    if num_kv_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    require(
        1 <= num_kv_splits <= MAX_KV_SPLITS and num_kv_splits & (num_kv_splits - 1) == 0,
        f"num_kv_splits {num_kv_splits} must be a power of two in [1, {MAX_KV_SPLITS}]",
    )
    group = num_q_heads // num_kv_heads
    fp16_dots = k_cache.dtype == FP8_DTYPE and q.dtype != torch.float32
    block_n, launch_opts = _decode_tiles(q.dtype, fp16_dots, num_seqs * num_kv_heads * num_kv_splits, head_dim,
                                         q.device, block_n, num_warps, num_stages)
    append_args, append_opts = append_launch_args(append, q, k_cache)
    part_o, part_lse, part_strides = _split_buffers(out, num_kv_splits)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_kv_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_o,
        part_lse,
        float(scale) * float(k_scale),
        float(soft_cap or 1.0),
        float(v_scale),
        1.0,
        int(sliding_window or 0),
        num_kv_splits,
        *paged_kv_strides(q, k_cache, v_cache, block_tables, out),
        *part_strides,
        group,
        *append_args,
        float(k_scale),
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_H=max(16, next_pow2(group)),
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        SPLIT=num_kv_splits > 1,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=soft_cap is not None,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=dot_upcast(),
        FP16_DOTS=fp16_dots,
        **append_opts,
        **launch_opts,
        **pdl_args(q.device),
    )
    if num_kv_splits > 1:
        merge_splits(part_o, part_lse, seq_lens, out, v_scale, sliding_window, block_n)
    return out


class DecodeLaunch(NamedTuple):
    """One compiled variant of `paged_decode_attention`: its split count and tile (the launcher's arguments)."""
    num_kv_splits: int
    block_n: int | None
    num_warps: int | None
    num_stages: int | None


def decode_launch_variants(q_dtype: torch.dtype, k_cache: torch.Tensor) -> list[DecodeLaunch]:
    """The launches that reach every compiled variant `paged_decode_attention` may run for queries of q_dtype over
    this cache (one split or several, each tile `_decode_tiles` picks for some grid size): an engine launches each
    once before serving, so that no step compiles one (~1.4 s each on an H100)."""
    fp16_dots = k_cache.dtype == FP8_DTYPE and q_dtype != torch.float32
    sms = num_sms(k_cache.device)
    tiles = []
    for num_programs in (1, _MAX_SMALL_GRID_PROGRAMS * sms + 1, _MIN_ONE_WARP_PROGRAMS * sms + 1):  # each regime
        block_n, opts = _decode_tiles(q_dtype, fp16_dots, num_programs, k_cache.shape[-1], k_cache.device, None, None,
                                      None)
        tile = (block_n, opts.get("num_warps"), opts.get("num_stages"))
        if tile not in tiles:
            tiles.append(tile)
    return [DecodeLaunch(num_kv_splits, *tile) for num_kv_splits in (1, 2) for tile in tiles]


# fp8 K/V on Hopper, by programs a multiprocessor: up to 4 five-stage 128-token tiles, past 6 one warp over 16-token
# tiles, four warps on three stages between; `KERNELS_FP8_DECODE_ONE_WARP=0` keeps four warps on every grid (the A/B
# switch of bench/gpu_engine.py)
_MAX_SMALL_GRID_PROGRAMS = 4
_MIN_ONE_WARP_PROGRAMS = 6
_ONE_WARP = os.environ.get("KERNELS_FP8_DECODE_ONE_WARP", "1") != "0"


def _decode_tiles(dtype: torch.dtype, fp16_dots: bool, num_programs: int, head_dim: int, device: torch.device,
                  block_n: int | None, num_warps: int | None, num_stages: int | None) -> tuple[int, dict]:
    """(BLOCK_N, launch options) for q's dtype and the grid's size; the caller's overrides win."""
    if is_interpreter():
        return block_n or 16, {}
    fp32 = dtype == torch.float32
    if fp16_dots:
        # NOTE: fp8 K/V is bound by the instructions a tile (widening, the softmax over a 16-row tile for a
        # group of 4 heads), not by memory. With four warps a program, each K/V tile's probabilities cross
        # warps through shared memory (~11 barriers a tile) and fp8 V is widened, stored and read back
        # transposed: Nsight Compute on an H100 (384 x 1,536): 18.75% occupancy, 6.9 cycles a warp instruction,
        # 20% of them register moves. One warp a program needs no barrier: on a large grid (> 6 programs a
        # multiprocessor) it reaches 0.92-0.95 of the copy rate over 16-token tiles, six stages deep, where four
        # warps over 128-token tiles reach 0.80-0.90 (384 x 1,536 451 -> 426 us; 256 x 1,024 222 -> 197;
        # 128 x 2,048 224 -> 193; 2026-11-28, bench/decode_attention_tune.py). With fewer programs one warp
        # leaves the multiprocessors idle (96 x 2,048: 0.78 against 0.86), so smaller grids keep 128-token tiles:
        # five stages keep two tiles in flight (the block-table load feeds the K/V addresses, so the pipeliner
        # holds one below five) but take 160 KiB of shared memory, one program a multiprocessor: they win while
        # the grid is small; past 4 programs a multiprocessor, three stages (two programs each) win (2026-11-27:
        # 64 x 4,096 0.58 -> 0.82, 16 x 4,096 0.52 -> 0.66, 1 x 16,384 0.40 -> 0.42).
        # (measured at head_dim 128; one warp holding a wider head's query and accumulator would spill)
        is_hopper = is_hopper_or_later(device)
        if (_ONE_WARP and is_hopper and head_dim <= 128
                and num_programs > _MIN_ONE_WARP_PROGRAMS * num_sms(device)):
            return block_n or 16, {"num_warps": num_warps or 1, "num_stages": num_stages or 6}
        block_n = block_n or 128
        num_warps = num_warps or 4
        is_small_grid = num_programs <= _MAX_SMALL_GRID_PROGRAMS * num_sms(device) and is_hopper
        num_stages = num_stages or (5 if is_small_grid else 3)
        return block_n, {"num_warps": num_warps, "num_stages": num_stages}
    block_n = block_n or (32 if fp32 else 64)
    num_warps = num_warps or (8 if fp32 else 4)  # NOTE: fp32 at 4 warps spills registers
    # bf16 streams at the copy rate with these (the tile sweeps in bench/kernels_bench.py).
    return block_n, {"num_warps": num_warps, "num_stages": num_stages or 3}


def _split_buffers(out: torch.Tensor, num_kv_splits: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(part_o [S, Hq, splits, D], part_lse [S, Hq, splits], their five strides) float32 for a split
    launch; with one split the kernel writes `out` directly and these are unused."""
    if num_kv_splits == 1:
        return out, out, (0,) * 5
    num_seqs, num_q_heads, head_dim = out.shape
    # NOTE: NaN in the interpreter, so that a merge reading a split nobody wrote fails the tests.
    make = torch.full if is_interpreter() else torch.empty
    fill = (float("nan"),) if is_interpreter() else ()
    part_o = make((num_seqs, num_q_heads, num_kv_splits, head_dim), *fill, dtype=torch.float32, device=out.device)
    part_lse = make((num_seqs, num_q_heads, num_kv_splits), *fill, dtype=torch.float32, device=out.device)
    return part_o, part_lse, (*part_o.stride()[:3], *part_lse.stride()[:2])

