"""Split-KV for decode attention: how a context is divided into splits, and the pass that merges
the splits' partial outputs.

    context of a sequence, split into num_splits slices of whole BLOCK_N tiles:
    [ tile | tile | tile | tile | tile | tile | tile ]   (last tile partial: masked)
    [ split 0    ][ split 1    ][ split 2    ][ 3 ]       (trailing splits may be empty)

A CUDA graph fixes num_splits for the longest context; a shorter one leaves trailing splits empty
(never written), and the merge, grid (num_seqs, num_q_heads), reads only the splits that hold a
partial, weighting each by its log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import cast, next_pow2, num_sms, pdl_args, pdl_enter

MAX_KV_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 128


@triton.jit
def split_bounds(seq_len, window, split, num_splits, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """(first visible key, [lo, hi) of this split, number of non-empty splits) of one sequence."""
    first = seq_len * 0
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    start = (first // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(seq_len - start, BLOCK_N)
    # NOTE: a CUDA graph fixes num_splits for the longest context it may meet: a short context
    # fills fewer splits (one tile each), and the merge reads only those.
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), 1)  # 1 for an empty context: no 0 / 0
    num_active = tl.cdiv(num_tiles, tiles_per_split)
    lo = start + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)
    return first, lo, hi, num_active


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    part_o_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    v_scale,
    window,
    num_splits,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,  # MAX_KV_SPLITS: one compiled merge for every split count
    USE_WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # NOTE: seq_lens comes from the host, not from the split kernel: read before the PDL wait
    _, _, _, num_active = split_bounds(tl.load(seq_lens_ptr + seq), window, 0, num_splits, BLOCK_N, USE_WINDOW)
    pdl_enter(USE_PDL)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_active  # partials of empty splits are never written
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + offs_s, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    o = tl.load(
        part_o_ptr + seq * stride_po_seq + head * stride_po_head + offs_s[:, None] * stride_po_split + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    o = tl.sum(o * w[:, None], 0) * (v_scale / denom)
    tl.store(out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d, cast(o, out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """A power-of-two split count that gives the GPU about four programs per multiprocessor.

    Fixed for a CUDA-graph capture: pass the result as `num_kv_splits` for every replay (the
    kernel divides each sequence's own context into that many slices)."""
    programs = max(num_seqs * num_kv_heads, 1)
    by_occupancy = max(1, (4 * num_sms(device)) // programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    splits = min(by_occupancy, by_length, MAX_KV_SPLITS)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def merge_splits(
    part_o: torch.Tensor,  # [num_seqs, num_q_heads, num_splits, head_dim] fp32
    part_lse: torch.Tensor,  # [num_seqs, num_q_heads, num_splits] fp32, log2 domain
    seq_lens: torch.Tensor,  # [num_seqs] int32
    out: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    v_scale: float,
    sliding_window: int | None,
    block_n: int,  # the tile the splits were cut in
) -> None:
    """Writes `out` from the partials of the splits each sequence's context filled, times `v_scale`."""
    num_seqs, num_q_heads, num_splits, head_dim = part_o.shape
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        part_o,
        part_lse,
        seq_lens,
        out,
        float(v_scale),
        int(sliding_window or 0),
        num_splits,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        BLOCK_N=block_n,
        BLOCK_S=MAX_KV_SPLITS,
        USE_WINDOW=sliding_window is not None,
        **pdl_args(out.device),
    )
