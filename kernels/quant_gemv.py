"""Weight-only quantized skinny matmul for decode: y = x @ dequant(w).T with 1..16 rows of x.

At decode batch sizes a linear layer is bound by reading its weight; a packed weight is 2-4x fewer
bytes. Each program owns BLOCK_N output columns for every row of x and streams its rows of the packed
weight once. Reading 4-bit weights at full bandwidth leaves a few instructions a weight, so the kernel
keeps the per-weight work to integer ops and one multiply-add, with no conversion instruction (those run
at a fraction of the FMA rate):

- a 4-bit code against 16-bit activations is shifted into the top of the mantissa of 1.0, the float
  1 + q / 16, and a group's sum(x * (q - z)) is 16 * sum(x * (1 + q / 16)) - (16 + z) * sum(x), the last
  sum shared by the tile's columns: no subtraction a weight, so the products fuse into the sums'
  multiply-adds (Nsight Compute on the H200: 5.4 M -> 2.0 M unfused FP32 instructions in gate_up, weight
  pass 323 -> 359 tok/s). Its rounding (4e-7 relative on random weights, against 1e-7) vanishes in a
  16-bit output; fp32 activations keep the subtraction, so their results stay exact to fp32 summation
  (a tensor-parallel shard's logits match one process's to 1e-5);
- other codes: the bits of (q | 0x4B000000) are the float 2**23 + q, and subtracting 2**23 + zero
  leaves q - zero exactly (both are integers below 2**24);
- scales, zeros and offsets are per group: each K tile is cut into chunks of one group each
  ([BLOCK_N, NUM_CHUNKS, CHUNK]), the products are summed within a chunk and scaled once per chunk,
  so w = s * (q - z) + o costs s * sum(x * (q - z)) + o * sum(x) per group instead of per weight.

Within each 32 columns byte j holds columns j and j + 16 (`quant_layout`), so a tile is two planes
(lo: columns j, hi: columns j + 16) multiplied by two strided views of x. Results equal
dequantize-then-matmul up to fp32 rounding.

The fused decoder's options are those of `kernels.gemv`: `gated` (x = [gate | up], the input is
silu(gate) * up), `norm_weight` (the input is rms_norm(x) * norm_weight: the sums of squares ride along
the K loop and scale the sums at the end) and `residual` (added to the output before rounding).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels._common import cast, interpreted_block_n, is_interpreter, next_pow2, pdl_args, pdl_enter
from kernels.activation import silu_and_mul
from kernels.norm import rms_norm
from kernels.quant_gemv_tc import quant_gemv_tc, takes_tensor_cores
from kernels.quant_layout import UNIT_SCALE, IntPackedWeight, kernel_args, tile_for, tile_parts

MAX_QUANT_GEMV_ROWS = 16  # the most rows the kernel takes (the fused decoder options need it)
# NOTE: past this many rows the tensor-core GEMM is faster than this kernel even at decode sizes, so past it
# `quant_matmul` sends the GEMV only fused calls (measured by `bench/gpu_quant.py --only crossover`) and the
# 4-bit codes `quant_gemv_tc` takes (faster than the GEMM up to 16 rows).
QUANT_GEMV_FASTER_ROWS = 2
# 8-bit codes (GGUF Q8_0, Q5_K / Q6_K held one a byte, int8) beat the GEMM here up to 4 rows (an H200, all of
# Llama-3-8B's projections, `bench/gpu_quant.py --only crossover`, 2026-11-29: Q8_0 at 3 / 4 rows 5.92 / 6.31 ms
# against the GEMM's 7.31 / 7.35, Q6_K 7.42 / 7.82 against 8.05 / 8.14; Q4_K at 3 rows 6.72 against 6.05)
BYTE_CODES_FASTER_ROWS = 4
# NOTE: read once at import (the A/B switch of bench/gpu_quant.py), like KERNELS_PDL's launches are fixed per run.
TENSOR_CORES = os.environ.get("KERNELS_QUANT_GEMV_TC", "1") != "0"
# From this many rows `quant_gemv_tc` takes the fused options in its own prologue (an H200,
# bench/quant_gemv_tc_tune.py, 2026-11-27: the fused projections at 2 rows 161 -> 107 us a layer, at 16 rows
# 1,031 -> 112). At one row that prologue, run on all 16 padded rows, costs more than it saves: ONE_ROW says what
# one row does instead (`KERNELS_QUANT_GEMV_ONE_ROW`, read once): "split" (the default): the prologue in a launch
# of its own (`silu_and_mul`, `rms_norm`), then the plain tensor-core GEMV; "fused": the tensor-core GEMV with its
# prologue; "cuda": the CUDA-core GEMV, fused (a gated row still takes its gate apart). Served int4 batch 1 on an
# H200 (weights in row tiles, 2026-11-27): split 346.3 tok/s, cuda 323.7, fused 263.6
# (bench/results/h200-2026-11-27).
TENSOR_CORE_ROWS = 2
ONE_ROW = os.environ.get("KERNELS_QUANT_GEMV_ONE_ROW", "split")
if ONE_ROW not in ("split", "fused", "cuda"):
    raise ValueError(f"KERNELS_QUANT_GEMV_ONE_ROW: split, fused or cuda, got {ONE_ROW!r}")


def gemv_faster_rows(w: IntPackedWeight) -> int:
    """The most rows of x at which this kernel beats the tensor-core GEMM for w's codes."""
    return BYTE_CODES_FASTER_ROWS if w.bits == 8 else QUANT_GEMV_FASTER_ROWS


def on_tensor_cores(w: IntPackedWeight, x: torch.Tensor) -> bool:
    """Whether the decode matmul of w runs on the tensor cores (`quant_gemv_tc`) when x has the rows for it."""
    return TENSOR_CORES and takes_tensor_cores(w, x)


@triton.jit
def _quant_gemv_kernel(
    x_ptr,  # [M, K] activations
    perm_ptr,  # [K] int32 packed column -> x column, or any pointer when not HAS_PERM
    b_ptr,  # [N] bias, or any pointer when not HAS_BIAS
    nw_ptr,  # [K] RMSNorm weight, or any pointer when not NORM
    r_ptr,  # [M, N] residual, or any pointer when not RESIDUAL
    y_ptr,  # [M, N]
    qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, stride_qs, stride_qh, stride_s,  # the packed weight
    M, N, K, eps, stride_xm, stride_rm, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr, GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr, UNIT_CODES: tl.constexpr,
    USE_PDL: tl.constexpr,
    TILE_N: tl.constexpr = 0,
):
    NUM_CHUNKS: tl.constexpr = BLOCK_K // 2 // CHUNK
    pdl_enter(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_lo, s_lo, o_lo, w_hi, s_hi, o_hi, cols_lo, cols_hi, in_k, z_lo, z_hi = tile_parts(
            qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s, BITS, GROUP,
            ZERO, HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP, UNIT_CODES, TILE_N=TILE_N)
        if HAS_PERM:
            cols_lo = tl.load(perm_ptr + cols_lo, mask=in_k, other=0)
            cols_hi = tl.load(perm_ptr + cols_hi, mask=in_k, other=0)
        if NORM:
            nw_lo = tl.load(nw_ptr + cols_lo, mask=in_k, other=0.0).to(tl.float32)
            nw_hi = tl.load(nw_ptr + cols_hi, mask=in_k, other=0.0).to(tl.float32)
        # NOTE: one row of x at a time against the widened tile held in registers: the products of a
        # row are [BN, NC, CHUNK], as at batch 1 (a [BM, BN, NC, CHUNK] broadcast spills registers).
        for mi in tl.static_range(BLOCK_M):
            x_row = x_ptr + tl.minimum(M - 1, mi).to(tl.int64) * stride_xm  # rows past M: never stored
            x_lo = _load_x(x_row, cols_lo, in_k, K, GATED)  # [BK/2] fp32
            x_hi = _load_x(x_row, cols_hi, in_k, K, GATED)
            if NORM:
                squares += tl.where(offs_m == mi, tl.sum(x_lo * x_lo) + tl.sum(x_hi * x_hi), 0.0)
                x_lo *= nw_lo
                x_hi *= nw_hi
            part = (_scaled_chunk_sums(tl.reshape(x_lo, (NUM_CHUNKS, CHUNK)), w_lo, s_lo, o_lo, z_lo, HAS_OFFSETS,
                                       UNIT_CODES)
                    + _scaled_chunk_sums(tl.reshape(x_hi, (NUM_CHUNKS, CHUNK)), w_hi, s_hi, o_hi, z_hi, HAS_OFFSETS,
                                         UNIT_CODES))
            acc += tl.where(offs_m[:, None] == mi, part[None, :], 0.0)
    if NORM:
        acc = acc / tl.sqrt(squares / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_mask = (offs_m[:, None] < M) & n_mask[None, :]
    if RESIDUAL:
        acc += tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=y_mask,
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], cast(acc, y_ptr.dtype.element_ty),
             mask=y_mask)


@triton.jit
def _scaled_chunk_sums(x, w, scale, offset, zero, HAS_OFFSETS: tl.constexpr, UNIT_CODES: tl.constexpr):
    """One row: sum over chunks of scale * sum(x * w) (+ offset * sum(x)): x [NC, CH], w [BN, NC, CH] (q - z),
    scale, offset [BN, NC] -> [BN]. UNIT_CODES: w is 1 + q / 16 and `zero` [BN, NC] 16 + z, so sum(x * (q - z))
    is 16 * sum(x * w) - zero * sum(x) (the sum of x shared by every column of the tile)."""
    sums = tl.sum(w * x[None, :, :], axis=2)  # [BN, NC]
    if UNIT_CODES or HAS_OFFSETS:
        x_sums = tl.sum(x, axis=1)[None, :]
    if UNIT_CODES:
        sums = sums * UNIT_SCALE - zero * x_sums
    sums = sums * scale
    if HAS_OFFSETS:
        sums += offset * x_sums
    return tl.sum(sums, axis=1)


@triton.jit
def _load_x(x_row, cols, mask, K, GATED: tl.constexpr):
    """Columns `cols` of a row of x, in fp32: x itself, or silu(gate) * up of x = [gate | up]."""
    if GATED:
        gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + cols, mask=mask, other=0.0).to(tl.float32)
        return gate * tl.sigmoid(gate) * up
    return tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)


def quant_gemv_config(n: int, gated: bool = False) -> dict:
    """Tiles measured best at one row (`bench/gpu_quant.py --sweep`, Llama-3-8B's int4 g128 projections,
    plain and with the fused decoder's options, H200, 2026-11-26): a 1024-wide K tile on 4 warps, 16 output
    columns a program for the wide layers and the gated down projection (whose SiLU prologue every program
    recomputes), 8 for the narrow ones: 1.1-2.3x the bandwidth of the earlier tiles (gate_up with its norm
    prologue 664 -> 1528 GB/s)."""
    return {"block_n": 16 if n >= 6144 or gated else 8, "block_k": 1024, "num_warps": 4, "num_stages": 3}


def quant_gemv(x: torch.Tensor, w: IntPackedWeight, bias: torch.Tensor | None = None, *, gated: bool = False,
               norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
               out: torch.Tensor | None = None, block_n: int | None = None, block_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] ([M, 2K] when gated; M <= MAX_QUANT_GEMV_ROWS) @ dequant(w).T + bias (+ residual) -> [M, N]
    in x's dtype, fp32 accumulation. Arguments are checked by `quant_matmul`, the entry point. From
    TENSOR_CORE_ROWS rows, 4-bit codes that `quant_gemv_tc` takes go to the tensor cores unless a tile is given
    (`KERNELS_QUANT_GEMV_TC=0`: never)."""
    if block_n is None and block_k is None and num_warps is None and on_tensor_cores(w, x):
        if x.shape[0] >= TENSOR_CORE_ROWS or ONE_ROW == "fused":
            return quant_gemv_tc(x, w, bias, gated=gated, norm_weight=norm_weight, eps=eps, residual=residual, out=out)
        # NOTE: groups of 32 (GGUF Q4_0) cost the tensor-core GEMV 1.5x the instructions a weight of groups of 128:
        # at one row the CUDA cores do as well (all layers at 16 rows, H100: 5.13 against the GEMM's 6.08 ms)
        if w.group_size >= 64:
            if gated:  # one row: the gate in its own launch, the product on the tensor cores (ONE_ROW's note)
                return quant_gemv_tc(silu_and_mul(x), w, bias, residual=residual, out=out)
            if ONE_ROW == "split":
                if norm_weight is not None:
                    x = rms_norm(x, norm_weight, eps)
                return quant_gemv_tc(x, w, bias, residual=residual, out=out)
    num_rows = x.shape[0]
    n, k = w.shape
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    tiles = quant_gemv_config(n, gated)
    block_n = block_n or interpreted_block_n(tiles["block_n"], n)
    block_k, chunking = tile_for(w, block_k or tiles["block_k"])
    opts = {} if is_interpreter() else {"num_warps": num_warps or tiles["num_warps"],
                                        "num_stages": num_stages or tiles["num_stages"]}
    args, consts = kernel_args(w)
    _quant_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w.perm if w.perm is not None else x, bias if bias is not None else x,
        norm_weight if norm_weight is not None else x, residual if residual is not None else x, out, *args,
        num_rows, n, k, eps, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), **consts,
        HAS_PERM=w.perm is not None, HAS_BIAS=bias is not None, GATED=gated, NORM=norm_weight is not None,
        UNIT_CODES=w.bits == 4 and x.dtype != torch.float32,
        RESIDUAL=residual is not None, BLOCK_M=next_pow2(num_rows), BLOCK_N=block_n, BLOCK_K=block_k, **chunking,
        **opts, **pdl_args(x.device))
    return out
