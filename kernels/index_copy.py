"""dst[dst_index] = src[src_index] in one launch: a step's pending token ids, sampled by the step in flight, gathered
into its input ids on the device (torch's index_select + index_copy_ were two launches a decode step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreter, next_pow2, require

_BLOCK = 1024


@triton.jit
def _gather_scatter_kernel(dst_ptr, dst_index_ptr, src_ptr, src_index_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dst_at = tl.load(dst_index_ptr + offs, mask=mask, other=0)
    src_at = tl.load(src_index_ptr + offs, mask=mask, other=0)
    tl.store(dst_ptr + dst_at, tl.load(src_ptr + src_at, mask=mask), mask=mask)


def gather_scatter(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor) -> None:
    """dst[dst_index] = src[src_index] for contiguous 1-D tensors of one dtype, int64 indices of equal length (the
    entries of `dst_index` distinct, each index in range: not checked, as the gather it replaces would not be)."""
    require(dst.dim() == src.dim() == 1 and dst.is_contiguous() and src.is_contiguous(),
            "dst, src: expected contiguous 1-D tensors")
    require(dst.dtype == src.dtype, lambda: f"dst {dst.dtype} and src {src.dtype} differ")
    require(dst_index.shape == src_index.shape and dst_index.dim() == 1, "indices: expected two of one length")
    require(dst_index.dtype == src_index.dtype == torch.int64, "indices: expected int64")
    n = dst_index.numel()
    if n == 0:
        return
    block = min(_BLOCK, next_pow2(n))
    opts = {} if is_interpreter() else {"num_warps": 1 if block <= 128 else 4}
    _gather_scatter_kernel[(triton.cdiv(n, block),)](dst, dst_index, src, src_index, n, BLOCK=block, **opts)
