"""Argument checks and strides shared by the paged attention launchers (decode and prefill).

Both kernels read q [T, Hq, D], a paged k/v cache [num_blocks, page_size, Hkv, D] through int32 block
tables, and write out [T, Hq, D]; `check_paged_kv` checks that contract once and `paged_kv_strides`
gives the strides both kernels take, in the order their signatures list them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels._common import (
    ACT_DTYPES,
    CACHE_DTYPES,
    FP8_DTYPE,
    is_interpreter,
    require,
    require_dtype,
    require_inner_contiguous,
    require_same_device,
    require_shape,
)

HEAD_DIMS = (64, 80, 96, 128, 256)


@dataclass(frozen=True, slots=True)
class PagedKVShape:
    """What the launchers read off the checked arguments."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    out: torch.Tensor  # the caller's `out`, or a fresh tensor like q


def check_paged_kv(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, page_size, Hkv, D]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    out: torch.Tensor | None,  # [T, Hq, D] or None
    *,
    sliding_window: int | None,
    soft_cap: float | None,
    query_start_loc: torch.Tensor | None = None,  # [num_seqs + 1] int32 (prefill)
    num_seqs: int | None = None,  # decode: one query row per sequence (q's rows); else seq_lens' length
) -> PagedKVShape:
    """Raises ValueError naming the first argument that breaks the launchers' contract; returns the
    shapes and the output tensor (allocated when `out` is None)."""
    require(q.dim() == 3, lambda: f"q: expected [num_tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    _, num_q_heads, head_dim = q.shape
    require(k_cache.dim() == 4, lambda: f"k_cache: expected 4 dims, got {tuple(k_cache.shape)}")
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    require_shape("k_cache", k_cache, (num_blocks, page_size, num_kv_heads, head_dim))
    require_shape("v_cache", v_cache, tuple(k_cache.shape))
    require(num_q_heads % num_kv_heads == 0, lambda: f"num_q_heads {num_q_heads} not a multiple of num_kv_heads {num_kv_heads}")
    require(head_dim in HEAD_DIMS or is_interpreter(), lambda: f"head_dim {head_dim} unsupported")
    num_seqs = seq_lens.shape[0] if num_seqs is None else num_seqs
    index_tensors = {"block_tables": block_tables, "seq_lens": seq_lens}
    if query_start_loc is not None:
        require_shape("seq_lens", seq_lens, (num_seqs,))
        require_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
        index_tensors["query_start_loc"] = query_start_loc
    require(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, lambda: f"block_tables: shape {tuple(block_tables.shape)}")
    require_shape("seq_lens", seq_lens, (num_seqs,))
    require_dtype("q", q, ACT_DTYPES)
    require_dtype("k_cache", k_cache, CACHE_DTYPES)
    require(v_cache.dtype == k_cache.dtype, "v_cache and k_cache dtypes differ")
    require(k_cache.dtype in (q.dtype, FP8_DTYPE), lambda: f"k_cache dtype {k_cache.dtype} must be q's ({q.dtype}) or fp8")
    for name, t in index_tensors.items():
        require_dtype(name, t, (torch.int32,))
    require(block_tables.stride(1) == 1 and all(t.is_contiguous() for t in index_tensors.values() if t is not block_tables),
            lambda: f"{', '.join(index_tensors)} rows must be contiguous")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        require_inner_contiguous(name, t)
    require(sliding_window is None or sliding_window > 0, "sliding_window must be positive")
    require(soft_cap is None or soft_cap > 0, "soft_cap must be positive")
    if out is None:
        out = torch.empty_like(q)
    else:
        require_shape("out", out, tuple(q.shape))
        require(out.dtype in ACT_DTYPES, lambda: f"out: dtype {out.dtype}")
        require_inner_contiguous("out", out)
    require_same_device(q=q, k_cache=k_cache, v_cache=v_cache, out=out, **index_tensors)
    return PagedKVShape(num_q_heads, num_kv_heads, head_dim, page_size, out)


def paged_kv_strides(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     out: torch.Tensor) -> tuple[int, ...]:
    """(q tok, q head, k block, k slot, k head, v block, v slot, v head, block-table row, out tok, out head)."""
    return (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            out.stride(0), out.stride(1))
