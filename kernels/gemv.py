"""Skinny matmul for decode: y = x @ w.T (+ bias) with few rows of x (the batch) and a large weight.

At batch 1-16 a linear layer is bound by reading its weight once from memory. Each program owns
BLOCK_N output columns: it streams its [BLOCK_N, K] slab of w (rows contiguous in K, so every load
is coalesced) through a [BLOCK_N, BLOCK_K] fp32 accumulator per row of x and reduces it once at the
end. No split over K: every output is one program's fixed-order sum, so the result of a row does not
depend on the batch it is in (batch invariance), and there are no atomics.

`gated=True` fuses the gated MLP's activation into the down projection: x holds [gate | up] and the
kernel multiplies silu(gate) * up (in fp32, never rounded) into the weight, saving a launch and a
round trip of the activation through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    cast,
    interpreted_block_n,
    is_interpreter,
    next_pow2,
    pdl_args,
    pdl_enter,
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
    b_ptr,  # [N] bias, or any pointer when not HAS_BIAS
    nw_ptr,  # [K] RMSNorm weight, or any pointer when not NORM
    r_ptr,  # [M, N] residual, or any pointer when not RESIDUAL
    N,
    K,
    eps,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_rm,
    M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # x rows are [gate (K) | up (K)]; the input is silu(gate) * up
    NORM: tl.constexpr,  # the input is rms_norm(x) * nw
    RESIDUAL: tl.constexpr,  # the output is x @ w.T + residual
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    # NOTE: no earlier kernel writes the weight, so the first two tiles are read before the PDL wait: a
    # program scheduled while the previous kernel's last ones still run has its first weights in flight
    # meanwhile. (The second is masked by K: it may lie past the end; zeros add nothing.)
    w = _load_w(w_rows, offs_k, K, mask_n, EVEN_K)
    w_second = _load_w(w_rows, BLOCK_K + offs_k, K, mask_n, False)
    pdl_enter(USE_PDL)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # NOTE: rms_norm(x) * nw @ w.T == rstd * ((x * nw) @ w.T), rstd a scalar per row: the sums of
    # squares ride along the main loop on the x chunks it loads anyway, and scale the sums at the end
    # (a separate pass over x first would hold back the weight stream).
    sq0 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    sq1 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    sq2 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    sq3 = tl.zeros((BLOCK_K,), dtype=tl.float32)
    acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3 = _accumulate(acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w, x_ptr,
                                                             nw_ptr, offs_k, K, stride_xm, M, GATED, NORM)
    acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3 = _accumulate(acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w_second,
                                                             x_ptr, nw_ptr, BLOCK_K + offs_k, K, stride_xm, M,
                                                             GATED, NORM)
    for k0 in range(2 * BLOCK_K, K, BLOCK_K):
        k = k0 + offs_k
        w = _load_w(w_rows, k, K, mask_n, EVEN_K)
        acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3 = _accumulate(acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w,
                                                                 x_ptr, nw_ptr, k, K, stride_xm, M, GATED, NORM)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    _store_row(y_ptr, r_ptr, acc0, sq0, K, eps, bias, offs_n, mask_n, NORM, RESIDUAL)
    if M > 1:
        _store_row(y_ptr + stride_ym, r_ptr + stride_rm, acc1, sq1, K, eps, bias, offs_n, mask_n, NORM, RESIDUAL)
    if M > 2:
        _store_row(y_ptr + 2 * stride_ym, r_ptr + 2 * stride_rm, acc2, sq2, K, eps, bias, offs_n, mask_n, NORM,
                   RESIDUAL)
    if M > 3:
        _store_row(y_ptr + 3 * stride_ym, r_ptr + 3 * stride_rm, acc3, sq3, K, eps, bias, offs_n, mask_n, NORM,
                   RESIDUAL)


@triton.jit
def _load_w(w_rows, k, K, mask_n, EVEN_K: tl.constexpr):
    """Weight columns k of the program's rows, in fp32 ([BLOCK_N, BLOCK_K])."""
    if EVEN_K:
        return tl.load(w_rows + k[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)
    return tl.load(w_rows + k[None, :], mask=mask_n[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _accumulate(acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3, w, x_ptr, nw_ptr, k, K, stride_xm, M: tl.constexpr,
                GATED: tl.constexpr, NORM: tl.constexpr):
    """Adds one K tile's products (w [BLOCK_N, BLOCK_K] times each row's x) and x's squares to the row sums."""
    if NORM:
        nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    else:
        nw = 1.0
    # x rows are tiny and stay in L1/L2; the weight is read exactly once.
    x0 = _load_x(x_ptr, k, K, GATED)
    sq0 += x0 * x0
    acc0 += w * (x0 * nw)[None, :]
    if M > 1:
        x1 = _load_x(x_ptr + stride_xm, k, K, GATED)
        sq1 += x1 * x1
        acc1 += w * (x1 * nw)[None, :]
    if M > 2:
        x2 = _load_x(x_ptr + 2 * stride_xm, k, K, GATED)
        sq2 += x2 * x2
        acc2 += w * (x2 * nw)[None, :]
    if M > 3:
        x3 = _load_x(x_ptr + 3 * stride_xm, k, K, GATED)
        sq3 += x3 * x3
        acc3 += w * (x3 * nw)[None, :]
    return acc0, acc1, acc2, acc3, sq0, sq1, sq2, sq3


@triton.jit
def _load_x(row_ptr, k, K, GATED: tl.constexpr):
    """Elements k of one input row, in fp32: x itself, or silu(gate) * up."""
    if GATED:
        gate = tl.load(row_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        up = tl.load(row_ptr + K + k, mask=k < K, other=0.0).to(tl.float32)
        return gate * tl.sigmoid(gate) * up
    return tl.load(row_ptr + k, mask=k < K, other=0.0).to(tl.float32)


@triton.jit
def _store_row(y_row, r_row, acc, squares, K, eps, bias, offs_n, mask_n, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """One output row: the reduced sums (scaled by the row's rstd under NORM), + bias, + residual."""
    y = tl.sum(acc, axis=1)
    if NORM:
        y = y / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    y += bias
    if RESIDUAL:
        y += tl.load(r_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_row + offs_n, cast(y, y_row.dtype.element_ty), mask=mask_n)


def gemv_config(num_rows: int, n: int, has_prologue: bool = False) -> dict:
    """Tiles measured best at one row (bench/gpu_decode_profile.py, Llama-3-8B shapes whole and on one rank of
    two, each projection with the prologue and epilogue the fused decode path gives it): wide K tiles, and
    fewer output columns a program the more columns there are. A prologue (the input's RMSNorm, the SiLU
    gate) is recomputed by every program: 8 columns on 4 warps then beat the plain tiles by 1.1-1.35x on an
    H200 (qkv, gate_up, down; 2026-11-26). The K tile and the warp count stay the same for every row count
    (they fix the summation order: batch invariance); more rows narrow the column tile instead, keeping
    the accumulators' registers in budget."""
    if has_prologue:
        block_n, num_warps = 8, 4
    else:
        # NOTE: below 4096 columns a 16-column tile leaves too few programs to balance over the SMs (H100: Phi-3's
        # o [3072 x 3072] 2144 GB/s at 16 columns, 2343 at 8; Qwen3-30B-A3B's o [2048 x 4096] 2056 at 16, 2254 at 2)
        block_n = 4 if n >= 16384 else 8 if n >= 6144 else 16 if n >= 4096 else 8 if n >= 3072 else 2
        num_warps = 8
    return {"block_n": min(block_n, 16 // next_pow2(num_rows)), "block_k": 1024, "num_warps": num_warps,
            "num_stages": 3}


def gemv(
    x: torch.Tensor,  # [M, K] ([M, 2K] = [gate | up] when gated), M <= MAX_GEMV_ROWS
    w: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    gated: bool = False,
    norm_weight: torch.Tensor | None = None,  # [K]
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,  # [M, N]
    out: torch.Tensor | None = None,  # [M, N]
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x @ w.T + bias for a few rows of x, accumulated in fp32 and rounded once to x's dtype.

    `gated`: the input is silu(gate) * up of x = [gate | up]. `norm_weight`: the input is
    rms_norm(x, eps) * norm_weight (the decoder's pre-projection norm, never rounded). `residual`:
    the output is x @ w.T + residual (the decoder's residual add). Tile arguments left None come
    from `gemv_config`. `w` is read before the PDL wait (kernels/README.md): a weight, not the output
    of the kernel launched just before."""
    require(x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] * (2 if gated else 1),
            lambda: f"x [M, {'2K' if gated else 'K'}] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    num_rows = x.shape[0]
    n, k = w.shape
    require(1 <= num_rows <= MAX_GEMV_ROWS, lambda: f"x: 1..{MAX_GEMV_ROWS} rows, got {num_rows}")
    require_dtype("x", x, ACT_DTYPES)
    require_dtype("w", w, ACT_DTYPES)
    require_inner_contiguous("x", x)
    require_inner_contiguous("w", w)
    require(bias is None or tuple(bias.shape) == (n,), lambda: f"bias: expected [{n}], got {None if bias is None else tuple(bias.shape)}")
    require(norm_weight is None or (not gated and tuple(norm_weight.shape) == (k,)),
            lambda: f"norm_weight: expected [{k}] and no gate, got {None if norm_weight is None else tuple(norm_weight.shape)}")
    require(residual is None or (tuple(residual.shape) == (num_rows, n) and residual.stride(-1) == 1),
            lambda: f"residual: expected [{num_rows}, {n}] with contiguous rows, got {None if residual is None else tuple(residual.shape)}")
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    require(tuple(out.shape) == (num_rows, n), lambda: f"out: shape {tuple(out.shape)} != {(num_rows, n)}")
    require_inner_contiguous("out", out)
    require_same_device(x=x, w=w, out=out)
    tiles = gemv_config(num_rows, n, has_prologue=gated or norm_weight is not None)
    block_n, block_k = block_n or interpreted_block_n(tiles["block_n"], n), block_k or tiles["block_k"]
    opts = {} if is_interpreter() else {"num_warps": num_warps or tiles["num_warps"],
                                        "num_stages": num_stages or tiles["num_stages"]}
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, bias if bias is not None else out, norm_weight if norm_weight is not None else out,
        residual if residual is not None else out, n, k, eps, x.stride(0), w.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0,
        M=num_rows, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None,
        GATED=gated, NORM=norm_weight is not None, RESIDUAL=residual is not None, **opts, **pdl_args(x.device))
    return out


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
             norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
    """float64 reference of `gemv`."""
    x = x.double()
    if gated:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = x @ w.double().T
    if bias is not None:
        y = y + bias.double()
    return y if residual is None else y + residual.double()
