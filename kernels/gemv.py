"""Skinny matmul for decode: y = x @ w.T with few rows of x (the batch) and a large weight.

At batch 1-16 a linear layer is bound by reading its weight once from memory. Each program owns
BLOCK_N output columns: it streams its [BLOCK_N, K] slab of w (rows contiguous in K, so every load
is coalesced) through a [BLOCK_N, BLOCK_K] fp32 accumulator per row of x and reduces it once at the
end. No split over K: every output is one program's fixed-order sum, so the result of a row does not
depend on the batch it is in (batch invariance), and there are no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    cast,
    is_interpreter,
    require,
    require_dtype,
    require_inner_contiguous,
    require_same_device,
)

MAX_GEMV_ROWS = 4  # more rows than this go to the library matmul (tensor cores pay off)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    y_ptr,  # [M, N]
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
        else:
            mask_k = k < K
            w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        # x rows are tiny and stay in L1/L2; the weight is read exactly once.
        x0 = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc0 += w * x0[None, :]
        if M > 1:
            x1 = tl.load(x_ptr + stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            acc1 += w * x1[None, :]
        if M > 2:
            x2 = tl.load(x_ptr + 2 * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            acc2 += w * x2[None, :]
        if M > 3:
            x3 = tl.load(x_ptr + 3 * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            acc3 += w * x3[None, :]
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_n, cast(tl.sum(acc0, axis=1), out_ty), mask=mask_n)
    if M > 1:
        tl.store(y_ptr + stride_ym + offs_n, cast(tl.sum(acc1, axis=1), out_ty), mask=mask_n)
    if M > 2:
        tl.store(y_ptr + 2 * stride_ym + offs_n, cast(tl.sum(acc2, axis=1), out_ty), mask=mask_n)
    if M > 3:
        tl.store(y_ptr + 3 * stride_ym + offs_n, cast(tl.sum(acc3, axis=1), out_ty), mask=mask_n)


def gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_GEMV_ROWS
    w: torch.Tensor,  # [N, K]
    *,
    out: torch.Tensor | None = None,  # [M, N]
    block_n: int = 8,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """x @ w.T for a few rows of x, accumulated in fp32 and rounded once to x's dtype."""
    require(x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1],
            f"x [M, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    num_rows, k = x.shape
    n = w.shape[0]
    require(1 <= num_rows <= MAX_GEMV_ROWS, f"x: 1..{MAX_GEMV_ROWS} rows, got {num_rows}")
    require_dtype("x", x, ACT_DTYPES)
    require_dtype("w", w, ACT_DTYPES)
    require_inner_contiguous("x", x)
    require_inner_contiguous("w", w)
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    require(tuple(out.shape) == (num_rows, n), f"out: shape {tuple(out.shape)} != {(num_rows, n)}")
    require_inner_contiguous("out", out)
    require_same_device(x=x, w=w, out=out)
    opts = {} if is_interpreter() else {"num_warps": num_warps, "num_stages": num_stages}
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, n, k, x.stride(0), w.stride(0), out.stride(0),
        M=num_rows, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, **opts)
    return out
