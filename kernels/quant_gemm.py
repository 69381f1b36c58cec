"""Weight-only quantized matmul for prefill and large batches: y = x @ dequant(w).T on tensor cores,
and `quant_matmul`, the entry point that picks it or the decode GEMV by the number of rows.

Each program owns a [BLOCK_M, BLOCK_N] output tile. Per K tile it widens the packed weight tile to
fp32 in registers (`dequant_tile`: codes by bit arithmetic, scales / zeros / offsets once a group), rounds it to the activation dtype and feeds two dots, one per
nibble plane (plane lo holds columns j of each 32, plane hi columns j + 16; x is loaded as the two
matching strided views), accumulating in fp32. The weight is read once per BLOCK_M rows of x, so
at large batch the kernel is compute-bound like a 16-bit GEMM plus the dequantization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    cast,
    dot_precision,
    dot_upcast,
    is_interpreter,
    mma,
    pdl_args,
    pdl_enter,
    require,
    require_dtype,
    require_inner_contiguous,
    require_same_device,
)
from kernels.quant_gemv import MAX_QUANT_GEMV_ROWS, QUANT_GEMV_FASTER_ROWS, quant_gemv
from kernels.quant_layout import IntPackedWeight, dequant_tile, kernel_args, tile_for


@triton.jit
def _quant_gemm_kernel(
    x_ptr,  # [M, K] activations
    perm_ptr,  # [K] int32 packed column -> x column, or any pointer when not HAS_PERM
    b_ptr,  # [N] bias, or any pointer when not HAS_BIAS
    y_ptr,  # [M, N]
    qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, stride_qs, stride_qh, stride_s,  # the packed weight
    M, N, K, stride_xm, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr, GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    act = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_lo, w_hi, cols_lo, cols_hi, in_k = dequant_tile(
            qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s, BITS, GROUP,
            ZERO, HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP)
        if HAS_PERM:
            cols_lo = tl.load(perm_ptr + cols_lo, mask=in_k, other=0)
            cols_hi = tl.load(perm_ptr + cols_hi, mask=in_k, other=0)
        x_mask = (offs_m[:, None] < M) & in_k[None, :]
        x_lo = tl.load(x_rows + cols_lo[None, :], mask=x_mask, other=0.0)  # [BM, BK/2]
        x_hi = tl.load(x_rows + cols_hi[None, :], mask=x_mask, other=0.0)
        acc = mma(x_lo, tl.trans(cast(w_lo, act)), acc, DOT_PREC, UPCAST)
        acc = mma(x_hi, tl.trans(cast(w_hi, act)), acc, DOT_PREC, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], cast(acc, y_ptr.dtype.element_ty),
             mask=y_mask)


def quant_gemm_config(num_rows: int, n: int) -> dict:
    """Tiles: a first guess for the GPU (bench/gpu_quant.py --sweep measures it)."""
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64 if num_rows <= 128 else 128
    return {"block_m": block_m, "block_n": 128, "block_k": 128, "num_warps": 8 if block_m >= 64 else 4,
            "num_stages": 3}


def quant_gemm(x: torch.Tensor, w: IntPackedWeight, bias: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
               block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None
               ) -> torch.Tensor:
    """x [M, K] @ dequant(w).T + bias -> [M, N] on tensor cores (weight rounded to x's dtype per tile),
    fp32 accumulation. Arguments are checked by `quant_matmul`, the entry point."""
    num_rows, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    tiles = quant_gemm_config(num_rows, n)
    block_m, block_n = block_m or tiles["block_m"], block_n or tiles["block_n"]
    block_k, chunking = tile_for(w, block_k or tiles["block_k"])
    opts = {} if is_interpreter() else {"num_warps": num_warps or tiles["num_warps"],
                                        "num_stages": num_stages or tiles["num_stages"]}
    args, consts = kernel_args(w)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n))
    _quant_gemm_kernel[grid](
        x, w.perm if w.perm is not None else x, bias if bias is not None else x, out, *args,
        num_rows, n, k, x.stride(0), out.stride(0), **consts, HAS_PERM=w.perm is not None,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **chunking,
        DOT_PREC=dot_precision(x.dtype), UPCAST=dot_upcast(), **opts, **pdl_args(x.device))
    return out


def quant_matmul(x: torch.Tensor, w: IntPackedWeight, bias: torch.Tensor | None = None, *, gated: bool = False,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w).T + bias -> [M, N] in x's dtype: the decode GEMV up to
    QUANT_GEMV_FASTER_ROWS rows, the tensor-core GEMM past it. Checks shapes, dtypes and devices.

    The fused decoder's options (`gated`, `norm_weight`, `residual`: see `kernels.gemv`) are decode
    options: they take at most MAX_QUANT_GEMV_ROWS rows."""
    n, k = w.shape
    is_fused = gated or norm_weight is not None or residual is not None
    require(x.dim() == 2 and x.shape[1] == k * (2 if gated else 1),
            lambda: f"x: expected [M, {'2K = ' + str(2 * k) if gated else k}], got {tuple(x.shape)}")
    require(1 <= x.shape[0] and (not is_fused or x.shape[0] <= MAX_QUANT_GEMV_ROWS),
            lambda: f"x: 1..{MAX_QUANT_GEMV_ROWS} rows with gated / norm_weight / residual, got {x.shape[0]}")
    require_dtype("x", x, ACT_DTYPES)
    require_inner_contiguous("x", x)
    require(bias is None or tuple(bias.shape) == (n,), lambda: f"bias: expected [{n}], got {None if bias is None else tuple(bias.shape)}")
    require(norm_weight is None or (not gated and tuple(norm_weight.shape) == (k,)),
            lambda: f"norm_weight: expected [{k}] and no gate, got {None if norm_weight is None else tuple(norm_weight.shape)}")
    require(residual is None or (tuple(residual.shape) == (x.shape[0], n) and residual.stride(-1) == 1),
            lambda: f"residual: expected [{x.shape[0]}, {n}] with contiguous rows, got {None if residual is None else tuple(residual.shape)}")
    if out is not None:
        require(tuple(out.shape) == (x.shape[0], n) and out.dtype == x.dtype,
                lambda: f"out: expected [{x.shape[0]}, {n}] {x.dtype}, got {tuple(out.shape)} {out.dtype}")
        require_inner_contiguous("out", out)
    require_same_device(x=x, qs=w.qs, scales=w.scales)
    if x.shape[0] <= QUANT_GEMV_FASTER_ROWS or is_fused:
        return quant_gemv(x, w, bias, gated=gated, norm_weight=norm_weight, eps=eps, residual=residual, out=out)
    return quant_gemm(x, w, bias, out=out)
