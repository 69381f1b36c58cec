"""The batch GEMM for 4-bit codes on the tensor cores, the weight as the left operand: y^T = dequant(w) @ x^T for
17..511 rows of x (past that `quant_widen` widens the weight once for cuBLAS).

Why not `quant_gemm` (x @ w^T, the widened weight as the right operand): at 256 rows a projection is bound by
what its programs read from L2 rather than by the weight from memory. A program's K step reads BN x 0.5 bytes of
codes and BM x 2 bytes of x for BN x BM multiply-adds, and the right operand of a Hopper MMA must come from
shared memory, which caps BN at 64 there (on an H100, 2026-11-27: gate_up 175-200 us against bf16 cuBLAS's 106,
x read ~450 times over). Here the weight is the MMA's A operand, taken from the registers it is widened in, as in
`quant_gemv_tc`: a program holds 128-256 weight rows and 64-256 rows of x, so x is read N / BN times.

Per K step (inside one group): two bytes become four codes in four instructions (`magic_codes`), the zero is
subtracted and the scale applied in packed fp16 / bf16, two weights an instruction, rounding the weight to x's
dtype once (as `quant_gemm`'s half-precision path does: equal to widen-then-matmul up to fp32 summation order);
the two nibble planes meet two strided views of x^T in two MMAs into one fp32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import _INTERPRETED, cast, is_interpreter, mma
from kernels.quant_gemv_tc import half_minus, half_times, k_step_bytes, magic_codes, row_offsets
from kernels.quant_layout import IntPackedWeight, _magic_plus


@triton.jit
def _quant_gemm_tc_kernel(
    x_ptr,  # [M, K] activations
    perm_ptr,  # [K] int32 packed column -> x column, or any pointer when not HAS_PERM
    b_ptr,  # [N] bias, or any pointer when not HAS_BIAS
    y_ptr,  # [M, N]
    qs_ptr, s_ptr, z_ptr, stride_qs, stride_s,  # the packed weight (4-bit codes, no offsets)
    M, N, K, stride_xm, stride_ym,
    GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    TILE_N: tl.constexpr,
):
    ACT: tl.constexpr = x_ptr.dtype.element_ty
    MAGIC: tl.constexpr = 128.0 if ACT == tl.bfloat16 else 1024.0
    # NOTE: the x tiles vary fastest, so the programs that widen the same weight rows run side by side (its
    # bytes come from memory once)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N read row N - 1 and are never stored
    x_rows = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm  # [1, BM]
    b = tl.arange(0, BLOCK_K // 2)  # a K step's bytes in a row
    plane_cols = (b // 16) * 32 + b % 16  # plane lo's columns; plane hi's are 16 further
    q_rows = row_offsets(rows, stride_qs, TILE_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K, a K step inside one group
        w_lo, w_hi = magic_codes(tl.load(k_step_bytes(qs_ptr, q_rows, k0, b, BLOCK_K, TILE_N)), ACT)
        group = k0 // GROUP
        if HAS_ZEROS:
            zero = _magic_plus(tl.load(z_ptr + rows * stride_s + group).to(tl.int16), ACT)[:, None]
        else:
            zero = tl.full((BLOCK_N, 1), MAGIC + ZERO, ACT)
        scale = cast(tl.load(s_ptr + rows * stride_s + group).to(tl.float32), ACT)[:, None]
        cols_lo = k0 + plane_cols
        cols_hi = cols_lo + 16
        if HAS_PERM:
            cols_lo = tl.load(perm_ptr + cols_lo)
            cols_hi = tl.load(perm_ptr + cols_hi)
        xt_lo = tl.load(x_rows + cols_lo[:, None], mask=m_mask[None, :], other=0.0)  # [BK/2, BM]
        xt_hi = tl.load(x_rows + cols_hi[:, None], mask=m_mask[None, :], other=0.0)
        acc = mma(half_times(half_minus(w_lo, zero), scale), xt_lo, acc, "tf32", _INTERPRETED)
        acc = mma(half_times(half_minus(w_hi, zero), scale), xt_hi, acc, "tf32", _INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    y_mask = (offs_n[:, None] < N) & m_mask[None, :]
    tl.store(y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None], cast(acc, y_ptr.dtype.element_ty),
             mask=y_mask)


def quant_gemm_tc_config(num_rows: int, n: int, k: int, group: int) -> dict:
    """Tiles: 256 weight rows a program (two warpgroups' MMAs), up to 128 rows of x, a K step of 128 columns
    (less where a group or K is shorter). Placeholder until bench/quant_gemm_tune.py measures them."""
    block_k = min(128, k & -k, group & -group)
    block_m = 64 if num_rows <= 64 else 128
    return {"block_n": 256, "block_m": block_m, "block_k": block_k, "num_warps": 8, "num_stages": 3}


def takes_gemm_tensor_cores(w: IntPackedWeight) -> bool:
    """Whether `quant_gemm_tc` takes this weight (`quant_gemv_tc.takes_tensor_cores` checks the rest): groups of 64
    columns or more (a K step of at least 64 inside one group)."""
    return w.group_size >= 64


def quant_gemm_tc(x: torch.Tensor, w: IntPackedWeight, bias: torch.Tensor | None = None, *,
                  out: torch.Tensor | None = None, block_n: int | None = None, block_m: int | None = None,
                  block_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w).T + bias -> [M, N] in x's dtype for a weight `takes_tensor_cores` and
    `takes_gemm_tensor_cores` accept. Arguments are checked by `quant_matmul`, the entry point; tiles default to
    `quant_gemm_tc_config`."""
    num_rows, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    tiles = quant_gemm_tc_config(num_rows, n, k, w.group_size)
    block_n, block_m = block_n or tiles["block_n"], block_m or tiles["block_m"]
    block_k = min(block_k or tiles["block_k"], tiles["block_k"])
    opts = {} if is_interpreter() else {"num_warps": num_warps or tiles["num_warps"],
                                        "num_stages": num_stages or tiles["num_stages"]}
    _quant_gemm_tc_kernel[(triton.cdiv(num_rows, block_m), triton.cdiv(n, block_n))](
        x, w.perm if w.perm is not None else x, bias if bias is not None else x, out,
        w.qs, w.scales, w.zeros if w.zeros is not None else w.scales, w.qs.stride(0), w.scales.stride(0),
        num_rows, n, k, x.stride(0), out.stride(0),
        GROUP=w.group_size, ZERO=float(w.zero), HAS_ZEROS=w.zeros is not None, HAS_PERM=w.perm is not None,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, TILE_N=w.tile_n, **opts)
    return out
