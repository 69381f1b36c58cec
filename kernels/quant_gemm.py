"""Weight-only quantized matmul for prefill and large batches: y = x @ dequant(w).T on tensor cores,
and `quant_matmul`, the entry point that picks it or the decode GEMV by the number of rows.

Each program owns a [BLOCK_M, BLOCK_N] output tile. Per K tile it widens the packed weight tile in
registers and feeds the tensor cores in x's dtype, accumulating in fp32. The weight comes as two nibble
planes (plane lo holds columns j of each 32, plane hi columns j + 16); up to 16 rows they meet two
strided views of x in two dots (`NATURAL` off), past that they are interleaved back into K order for one
dot with a contiguous x tile (on an H100 at 256 rows: 0.49 of bf16 cuBLAS's speed against 0.27 for two
dots, bench/quant_gemm_tune.py). 4-bit codes without offsets in fp16 / bf16 are dequantized in that
dtype (`HALF`: packed half-precision ops, two weights an instruction); the rest through fp32
(`dequant_tile`). The weight is read once per BLOCK_M rows of x.

NOTE: launched without programmatic dependent launch: 32 layers' projections at 16 rows took 4.7 ms
without it and 5.1-7.8 ms with it, depending on the order of the shapes (an H100, 2026-11-27); the
decode steps where PDL pays (1-2 rows) take the GEMV.
"""

from __future__ import annotations

import os

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
    require,
    require_dtype,
    require_inner_contiguous,
    require_same_device,
)
from kernels.quant_gemv import MAX_QUANT_GEMV_ROWS, gemv_faster_rows, on_tensor_cores, quant_gemv
from kernels.quant_gemv_tc import quant_gemv_tc
from kernels.quant_gemv_tc_tiles import row_blocks_win
from kernels.quant_layout import (
    IntPackedWeight,
    act_planes,
    kernel_args,
    planes_in_k_order,
    takes_half_planes,
    tile_for,
)
from kernels.quant_widen import widened_matmul


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
    CHUNK: tl.constexpr, GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr, NATURAL: tl.constexpr,
    HALF: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    TILE_N: tl.constexpr = 0,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    act = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_lo, w_hi, cols_lo, cols_hi, in_k = act_planes(
            qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s, BITS, GROUP,
            ZERO, HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP, HALF, act, TILE_N=TILE_N)
        if NATURAL:
            w = planes_in_k_order(w_lo, w_hi, BLOCK_N, BLOCK_K)
            cols = k0 + tl.arange(0, BLOCK_K)
            in_k_cols = cols < K
            if HAS_PERM:
                cols = tl.load(perm_ptr + cols, mask=in_k_cols, other=0)
            x = tl.load(x_rows + cols[None, :], mask=m_mask[:, None] & in_k_cols[None, :], other=0.0)  # [BM, BK]
            acc = mma(x, tl.trans(w), acc, DOT_PREC, UPCAST)
        else:
            if HAS_PERM:
                cols_lo = tl.load(perm_ptr + cols_lo, mask=in_k, other=0)
                cols_hi = tl.load(perm_ptr + cols_hi, mask=in_k, other=0)
            x_mask = m_mask[:, None] & in_k[None, :]
            x_lo = tl.load(x_rows + cols_lo[None, :], mask=x_mask, other=0.0)  # [BM, BK/2]
            x_hi = tl.load(x_rows + cols_hi[None, :], mask=x_mask, other=0.0)
            acc = mma(x_lo, tl.trans(w_lo), acc, DOT_PREC, UPCAST)
            acc = mma(x_hi, tl.trans(w_hi), acc, DOT_PREC, UPCAST)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_mask = m_mask[:, None] & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], cast(acc, y_ptr.dtype.element_ty),
             mask=y_mask)


# From this many rows (fp16 / bf16 on the GPU) the whole weight is widened for cuBLAS: bench/quant_gemm_tune.py.
WIDEN_ROWS = 512
# Below WIDEN_ROWS the 4-bit codes `quant_gemv_tc` takes go to it in row blocks rather than to this GEMM where
# that measured faster (`row_blocks_win`: every weight up to 64 rows, the wide and the long ones past): the
# widened weight feeds the MMA from registers, no shared-memory round trip. NOTE: read once at import (`KERNELS_QUANT_TC_ROW_BLOCKS=0`: the A/B
# switch of bench/gpu_quant.py).
TC_ROW_BLOCKS = os.environ.get("KERNELS_QUANT_TC_ROW_BLOCKS", "1") != "0"


def quant_gemm_config(num_rows: int, n: int, dtype: torch.dtype) -> dict:
    """Tiles an H100 measured best (bench/quant_gemm_tune.py, 2026-11-27): the two planes' dots with 16-row
    tiles up to 16 rows, one dot in K order past; 256-row tiles for wide weights at large batch (the weight
    widened once for 256 rows). fp32 activations (the CPU's) take smaller tiles: shared memory."""
    if num_rows <= 16:
        wide = n >= 16384
        tiles = {"block_m": 16, "block_n": 128 if wide else 64, "num_warps": 4 if wide else 8, "natural": False}
    elif num_rows <= 64:
        tiles = {"block_m": 64, "block_n": 64, "num_warps": 4, "natural": True}
    elif num_rows > 128 and n >= 6144:
        tiles = {"block_m": 256, "block_n": 64, "num_warps": 4, "natural": True}
    else:
        tiles = {"block_m": 128, "block_n": 64, "num_warps": 8, "natural": True}
    if dtype == torch.float32:
        tiles["block_m"] = min(tiles["block_m"], 64)
    return {**tiles, "block_k": 128, "num_stages": 2 if dtype == torch.float32 else 3}


def quant_gemm(x: torch.Tensor, w: IntPackedWeight, bias: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
               block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
               natural: bool | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w).T + bias -> [M, N] on tensor cores (weight rounded to x's dtype per tile),
    fp32 accumulation. Arguments are checked by `quant_matmul`, the entry point; tiles and `natural` (one dot
    in K order, else one a nibble plane) default to `quant_gemm_config`."""
    num_rows, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    tiles = quant_gemm_config(num_rows, n, x.dtype)
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
        NATURAL=tiles["natural"] if natural is None else natural, HALF=takes_half_planes(w, x.dtype, chunking),
        DOT_PREC=dot_precision(x.dtype), UPCAST=dot_upcast(), **opts)
    return out


def quant_matmul(x: torch.Tensor, w: IntPackedWeight, bias: torch.Tensor | None = None, *, gated: bool = False,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w).T + bias -> [M, N] in x's dtype: the decode GEMV up to `gemv_faster_rows` rows
    (2; 4 for 8-bit codes; up to 16 for the 4-bit codes `quant_gemv_tc` takes: all of Llama-3-8B's
    projections at 16 rows 5.07 -> 3.10 ms against this GEMM on an H200; past 16 they take it in row blocks
    where that measured faster, TC_ROW_BLOCKS), the tensor-core GEMM past it, and on the GPU from WIDEN_ROWS
    rows of fp16 / bf16 the widened weight through cuBLAS (`kernels.quant_widen`).
    Checks shapes, dtypes and devices.

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
    if (x.shape[0] <= gemv_faster_rows(w) or is_fused
            or (x.shape[0] <= MAX_QUANT_GEMV_ROWS and on_tensor_cores(w, x))):
        return quant_gemv(x, w, bias, gated=gated, norm_weight=norm_weight, eps=eps, residual=residual, out=out)
    if x.shape[0] >= WIDEN_ROWS and x.is_cuda and x.dtype != torch.float32:
        return widened_matmul(x, w, bias, out=out)
    if TC_ROW_BLOCKS and on_tensor_cores(w, x) and row_blocks_win(w, x.shape[0]):
        return quant_gemv_tc(x, w, bias, out=out)
    return quant_gemm(x, w, bias, out=out)
