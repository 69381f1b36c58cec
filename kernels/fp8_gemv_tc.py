"""The decode GEMV for e4m3 weights on the tensor cores: y = x @ (weight * scale blocks).T with 1..16 rows of x.

The CUDA-core GEMV (`fp8_gemv`) spends ~4-5 instructions a weight (the byte taken out of its word, its bits moved
into an fp32, one multiply-add): at one row on an H100 it streams its weight at ~2.0 TB/s where the bf16 GEMV's
two weights an instruction reach ~2.8. Here, as in `quant_gemv_tc`, the weight is the MMA's A operand, widened in
registers: e4m3 pairs become fp16 pairs in one instruction (`cvt.rn.f16x2.e4m3x2`), exactly (every e4m3 value is
an fp16). x^T, padded to 16 columns, meets them in fp16: each K step's x tile is scaled per row by the power of two
that puts its largest element in [2**14, 2**15), so a 16-bit activation loses nothing (fp16 keeps 11 bits; only
elements below 2**-32 of the tile's largest would round). The products are exact in the fp32 accumulator; each K
step's partial is multiplied by its scale block's scale and by the inverse power of two: the result is
dequantize-then-matmul up to fp32 summation order, as the CUDA-core GEMV's is.

Narrow layers split K (`kernels.split_k`), deterministically.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels._common import _INTERPRETED, cast, compute_capability, is_interpreter, mma, num_sms, pdl_args, pdl_enter
from kernels.split_k import arrive, split_args, split_for, sum_partials

MAX_ROWS = 16  # x^T padded to the MMA's smallest N
PAD_ROWS = tl.constexpr(MAX_ROWS)
# NOTE: read once at import (the A/B switch of bench/gpu_quant.py): "0" keeps one row on the CUDA-core GEMV.
TENSOR_CORES = os.environ.get("KERNELS_FP8_GEMV_TC", "1") != "0"


@triton.jit
def _pow2_scales(amax):
    """(mul, inv) fp32 [R]: powers of two with amax * mul in [2**14, 2**15), inv = 1 / mul (both exact; amax 0 or
    below 2**-112 takes 2**127, its products are zeros or far below any other)."""
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 255  # biased: amax in [2**(e - 127), 2**(e - 126))
    exponent = tl.minimum(tl.maximum(exponent, 15), 254)
    mul = ((268 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**(141 - (e - 127) - 127) = 2**(14 - log2)
    inv = ((exponent - 14) << 23).to(tl.float32, bitcast=True)
    return mul, inv


@triton.jit
def _fp8_gemv_tc_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N, K] e4m3
    s_ptr,  # [cdiv(N, GROUP_N), cdiv(K, GROUP_K)] float32
    b_ptr,  # [N] bias, or any pointer when not HAS_BIAS
    r_ptr,  # [M, N] residual, or any pointer when not RESIDUAL
    y_ptr,  # [M, N]
    ws_ptr,  # [SPLIT_K, 16, N] fp32 partials (zero), or any pointer when SPLIT_K == 1
    count_ptr,  # [cdiv(N, BLOCK_N)] int32 arrivals (zero), or any pointer when SPLIT_K == 1
    M, N, K, stride_xm, stride_wn, stride_s, stride_rm, stride_ym,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N read row N - 1 and are never stored
    offs_m = tl.arange(0, PAD_ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None] * stride_wn
    s_rows = s_ptr + (rows // GROUP_N) * stride_s
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [BK, 16]
    x_mask = offs_m[None, :] < M
    acc = tl.zeros((BLOCK_N, PAD_ROWS), dtype=tl.float32)
    k_split = tl.cdiv(K // BLOCK_K, SPLIT_K) * BLOCK_K  # K is a multiple of BLOCK_K
    k_begin = tl.multiple_of(tl.program_id(1) * k_split, BLOCK_K)
    for k0 in range(k_begin, tl.minimum(k_begin + k_split, K), BLOCK_K):  # a K step inside one scale block
        w = tl.load(w_rows + k0 + offs_k[None, :]).to(tl.float16)  # [BN, BK], exact
        xt = tl.load(x_cols + k0, mask=x_mask, other=0.0).to(tl.float32)  # [BK, 16]
        mul, inv = _pow2_scales(tl.max(tl.abs(xt), axis=0))
        part = mma(w, (xt * mul[None, :]).to(tl.float16), tl.zeros((BLOCK_N, PAD_ROWS), dtype=tl.float32), "tf32",
                   _INTERPRETED)
        scale = tl.load(s_rows + k0 // GROUP_K)  # [BN]
        acc += part * scale[:, None] * inv[None, :]
    ws_at = offs_m[None, :] * N + offs_n[:, None]  # [BN, 16] in one split's [16, N] slab
    if SPLIT_K > 1:
        if arrive(acc, ws_ptr, count_ptr, pid_n, tl.program_id(1), PAD_ROWS * N, ws_at, n_mask, SPLIT_K):
            acc = sum_partials(ws_ptr, count_ptr, pid_n, PAD_ROWS * N, ws_at, n_mask, SPLIT_K, BLOCK_N, PAD_ROWS)
            _finish(acc, b_ptr, r_ptr, y_ptr, offs_n, n_mask, offs_m, M, stride_rm, stride_ym, HAS_BIAS, RESIDUAL)
    else:
        _finish(acc, b_ptr, r_ptr, y_ptr, offs_n, n_mask, offs_m, M, stride_rm, stride_ym, HAS_BIAS, RESIDUAL)


@triton.jit
def _finish(acc, b_ptr, r_ptr, y_ptr, offs_n, n_mask, offs_m, M, stride_rm, stride_ym, HAS_BIAS: tl.constexpr,
            RESIDUAL: tl.constexpr):
    """y^T tile [BN, 16] = acc (+ bias) (+ residual), rounded to y's dtype, rows < M stored."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    mask = n_mask[:, None] & (offs_m[None, :] < M)
    rows = offs_m[None, :].to(tl.int64)
    if RESIDUAL:
        acc += tl.load(r_ptr + rows * stride_rm + offs_n[:, None], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows * stride_ym + offs_n[:, None], cast(acc, y_ptr.dtype.element_ty), mask=mask)


def takes_fp8_tensor_cores(x: torch.Tensor, k: int, block_k: int) -> bool:
    """Whether `fp8_gemv_tc` takes this input: fp16 / bf16 rows (at most 16) on a GPU that widens e4m3 in one
    instruction (compute capability 8.9 or later) or the interpreter, K and the scale blocks' width multiples of 16."""
    return (x.dtype in (torch.float16, torch.bfloat16) and x.shape[0] <= MAX_ROWS and k % 16 == 0
            and (block_k >= k or block_k % 16 == 0)
            and (is_interpreter() or (x.is_cuda and compute_capability(x.device) >= (8, 9))))


def fp8_gemv_tc_config(n: int, k: int, block_k: int, device: torch.device) -> dict:
    """64 output columns a program (a warpgroup's MMA), a K step of up to 128 columns inside one scale block, and K
    split until the grid holds 1.5 programs an SM."""
    step = min(128, k & -k, block_k & -block_k if block_k < k else 128)
    return {"block_n": 64, "block_k": step, "split_k": split_for(triton.cdiv(n, 64), k, step, num_sms(device)),
            "num_warps": 4, "num_stages": 4}


def fp8_gemv_tc(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
                bias: torch.Tensor | None = None, *, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None, tile_n: int | None = None, split_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """`fp8_gemv` on the tensor cores for an input `takes_fp8_tensor_cores` accepts: x [M, K] @ (weight * scale
    blocks).T + bias (+ residual) -> [M, N] in x's dtype. Arguments are checked by `fp8_linear`, the entry point."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    tiles = fp8_gemv_tc_config(n, k, block_k, x.device)
    tile_n = tile_n or tiles["block_n"]
    split = split_k or tiles["split_k"]
    ws, counts = split_args(x.device, split, MAX_ROWS, n, triton.cdiv(n, tile_n), x)
    opts = {} if is_interpreter() else {"num_warps": num_warps or tiles["num_warps"],
                                        "num_stages": num_stages or tiles["num_stages"]}
    _fp8_gemv_tc_kernel[(triton.cdiv(n, tile_n), split)](
        x, weight, scale, bias if bias is not None else x, residual if residual is not None else x, out, ws, counts,
        num_rows, n, k, x.stride(0), weight.stride(0), scale.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), GROUP_N=block_n, GROUP_K=block_k,
        HAS_BIAS=bias is not None, RESIDUAL=residual is not None, BLOCK_N=tile_n, BLOCK_K=tiles["block_k"],
        SPLIT_K=split, **opts, **pdl_args(x.device))
    return out
