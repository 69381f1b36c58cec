"""Weight-only quantized skinny matmul for decode: y = x @ dequant(w).T with 1..16 rows of x.

At decode batch sizes a linear layer is bound by reading its weight; a packed weight is 2-4x fewer
bytes. Each program owns BLOCK_N output columns for every row of x and streams its rows of the packed
weight once. Reading 4-bit weights at full bandwidth leaves a few instructions a weight, so the kernel
keeps the per-weight work to integer ops and one multiply-add, with no conversion instruction (those run
at a fraction of the FMA rate):

- 4-bit codes are read as 32-bit words of eight; each code is shifted into the top of the mantissa of
  1.0 and OR-ed in, the float 1 + q / 16, and a group's sum(x * (q - z)) is 16 * sum(x * (1 + q / 16))
  - (16 + z) * sum(x), the last sum shared by the program's rows (`_int4_tile`);
- 5-, 6- and 8-bit codes are read a byte each: the bits of (q | 0x4B000000) are the float 2**23 + q, and
  subtracting 2**23 + zero leaves q - zero exactly (both integers below 2**24) (`_byte_tile`);
- scales, zeros and offsets are per group: each K tile is cut into chunks of one group each, the
  products are summed within a chunk and scaled once per chunk, so w = s * (q - z) + o costs
  s * sum(x * (q - z)) + o * sum(x) per group instead of per weight.

Within each 32 columns byte j holds columns j and j + 16 (`quant_layout`), so a tile is two planes
(lo: columns j, hi: columns j + 16) multiplied by matching views of x. Results equal
dequantize-then-matmul up to fp32 rounding.

The fused decoder's options are those of `kernels.gemv`: `gated` (x = [gate | up], the input is
silu(gate) * up), `norm_weight` (the input is rms_norm(x) * norm_weight: the sums of squares ride along
the K loop and scale the sums at the end) and `residual` (added to the output before rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import cast, is_interpreter, next_pow2, pdl_args, pdl_enter
from kernels.quant_layout import MAGIC_VALUE, IntPackedWeight, _group_params, kernel_args, tile_for, tile_parts

MAX_QUANT_GEMV_ROWS = 16  # the most rows the kernel takes (the fused decoder options need it)
# NOTE: past this many rows the tensor-core GEMM is faster even at decode sizes, so past it
# `quant_matmul` sends the GEMV only fused calls (measured by `bench/gpu_quant.py --only crossover`).
QUANT_GEMV_FASTER_ROWS = 2


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
    CHUNK: tl.constexpr, GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if BITS == 4:
            acc, squares = _int4_tile(acc, squares, x_ptr, perm_ptr, nw_ptr, qs_ptr, s_ptr, z_ptr, o_ptr, offs_n, offs_m,
                                      k0, M, N, K, stride_xm, stride_qs, stride_s, GROUP, ZERO, HAS_ZEROS, HAS_OFFSETS,
                                      HAS_PERM, GATED, NORM, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP)
        else:
            acc, squares = _byte_tile(acc, squares, x_ptr, perm_ptr, nw_ptr, qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n,
                                      offs_m, k0, M, N, K, stride_xm, stride_qs, stride_qh, stride_s, BITS, GROUP, ZERO,
                                      HAS_ZEROS, HAS_OFFSETS, HAS_PERM, GATED, NORM, BLOCK_M, BLOCK_N, BLOCK_K, CHUNK,
                                      GROUP_STEP, HI_GROUP)
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
def _byte_tile(acc, squares, x_ptr, perm_ptr, nw_ptr, qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, offs_m, k0, M, N,
               K, stride_xm, stride_qs, stride_qh, stride_s, BITS: tl.constexpr, GROUP: tl.constexpr,
               ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_PERM: tl.constexpr,
               GATED: tl.constexpr, NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr):
    """One K tile of 5-, 6- and 8-bit codes (a code a byte, plus high bits): (acc, squares) updated."""
    NUM_CHUNKS: tl.constexpr = BLOCK_K // 2 // CHUNK
    w_lo, s_lo, o_lo, w_hi, s_hi, o_hi, cols_lo, cols_hi, in_k = tile_parts(
        qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s, BITS, GROUP,
        ZERO, HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP)
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
        part = (_scaled_chunk_sums(tl.reshape(x_lo, (NUM_CHUNKS, CHUNK)), w_lo, s_lo, o_lo, HAS_OFFSETS)
                + _scaled_chunk_sums(tl.reshape(x_hi, (NUM_CHUNKS, CHUNK)), w_hi, s_hi, o_hi, HAS_OFFSETS))
        acc += tl.where(offs_m[:, None] == mi, part[None, :], 0.0)
    return acc, squares


@triton.jit
def _int4_tile(acc, squares, x_ptr, perm_ptr, nw_ptr, qs_ptr, s_ptr, z_ptr, o_ptr, offs_n, offs_m, k0, M, N, K,
               stride_xm, stride_qs, stride_s, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
               HAS_OFFSETS: tl.constexpr, HAS_PERM: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
               GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr):
    """One K tile of 4-bit codes, read as 32-bit words of eight: (acc, squares) updated.

    Word j of a run of 16 bytes holds bytes 4j .. 4j + 3: byte b's low nibble is column 4j + b of the run's
    32, its high nibble column 16 + 4j + b. Rotating the word moves one nibble to the top of the mantissa
    of 1.0, and OR-ing it into those bits makes the float 1 + q / 16: one rotate and one logic op a code,
    no conversion and no subtraction, since per group sum((q - z) * x) = 16 * sum((1 + q / 16) * x)
    - (16 + z) * sum(x), the last sum shared by every row of the tile. (x times values in [1, 2) keeps the
    rounding near plain fp32's: 4e-7 relative on random weights, against 1e-7 for a subtraction a code.)"""
    NUM_CHUNKS: tl.constexpr = BLOCK_K // 2 // CHUNK
    CHUNK_WORDS: tl.constexpr = CHUNK // 4  # a chunk's lo-plane columns: four a word
    n_mask = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    chunks = tl.arange(0, NUM_CHUNKS)
    word = chunks[:, None] * CHUNK_WORDS + tl.arange(0, CHUNK_WORDS)[None, :]  # [NC, CW] within the tile
    byte = tl.arange(0, 4)
    # [NC, CW, 4] the lo-plane column of each nibble (the hi plane's is 16 more); whole runs are in or out of K
    cols_lo = k0 + (word // 4 * 32 + word % 4 * 4)[:, :, None] + byte[None, None, :]
    in_k = cols_lo < K
    words = tl.load(qs_ptr.to(tl.pointer_type(tl.uint32)) + rows[:, :, None] * (stride_qs // 4)
                    + (k0 // 8 + word)[None, :, :], mask=n_mask[:, None, None] & ((k0 + word // 4 * 32) < K)[None, :, :],
                    other=0)  # [BN, NC, CW]
    f_lo = _nibbles(words, 19 - 8 * byte)  # [BN, NC, CW, 4]: 1 + q / 16 of byte b's low nibble
    f_hi = _nibbles(words, 15 - 8 * byte)  # ... and of its high nibble
    group_lo = k0 // GROUP + chunks * GROUP_STEP
    in_groups = (k0 + chunks * (2 * CHUNK)) < K
    z_lo, s_lo, o_lo = _group_params(z_ptr, s_ptr, o_ptr, rows, group_lo, n_mask, in_groups, stride_s, ZERO, HAS_ZEROS,
                                     HAS_OFFSETS)  # [BN, NC] each
    if HI_GROUP == 0:
        z_hi = z_lo
        s_hi = s_lo
        o_hi = o_lo
    else:
        z_hi, s_hi, o_hi = _group_params(z_ptr, s_ptr, o_ptr, rows, group_lo + HI_GROUP, n_mask, in_groups, stride_s,
                                         ZERO, HAS_ZEROS, HAS_OFFSETS)
    # (2**23 + z) - (2**23 - 16) = 16 + z exactly: the per-group term of the sums above
    z_lo = z_lo - (MAGIC_VALUE - 16.0)
    z_hi = z_hi - (MAGIC_VALUE - 16.0)
    for mi in tl.static_range(BLOCK_M):
        x_row = x_ptr + tl.minimum(M - 1, mi).to(tl.int64) * stride_xm  # rows past M: never stored
        x_lo, y_lo = _x_at(x_row, perm_ptr, nw_ptr, cols_lo, in_k, K, HAS_PERM, GATED, NORM)  # [NC, CW, 4] each
        x_hi, y_hi = _x_at(x_row, perm_ptr, nw_ptr, cols_lo + 16, in_k, K, HAS_PERM, GATED, NORM)
        if NORM:
            squares += tl.where(offs_m == mi, tl.sum(tl.sum(tl.sum(x_lo * x_lo + x_hi * x_hi, 2), 1), 0), 0.0)
        part = (_int4_chunk_sums(f_lo, y_lo, z_lo, s_lo, o_lo, HAS_OFFSETS)
                + _int4_chunk_sums(f_hi, y_hi, z_hi, s_hi, o_hi, HAS_OFFSETS))
        acc += tl.where(offs_m[:, None] == mi, part[None, :], 0.0)
    return acc, squares


@triton.jit
def _nibbles(words, shifts):
    """words [BN, NC, CW] rotated left by each of `shifts` [4] (mod 32) -> the nibble now at bits 19-22 as the
    float 1 + q / 16, [BN, NC, CW, 4]."""
    amounts = (shifts & 31).to(tl.uint32)[None, None, None, :]
    w = words[:, :, :, None]
    rotated = (w << amounts) | (w >> ((32 - amounts) & 31))
    return ((rotated & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_chunk_sums(f, y, zero, scale, offset, HAS_OFFSETS: tl.constexpr):
    """One plane of one row: sum over chunks of scale * (16 * sum(f * y) - (16 + z) * sum(y)) (+ offset * sum(y)):
    f [BN, NC, CW, 4], y [NC, CW, 4], zero (16 + z), scale, offset [BN, NC] -> [BN]."""
    sums = tl.sum(tl.sum(f * y[None, :, :, :], axis=3), axis=2)  # [BN, NC]
    y_chunk = tl.sum(tl.sum(y, axis=2), axis=1)[None, :]  # [1, NC]
    sums = (sums * 16.0 - zero * y_chunk) * scale
    if HAS_OFFSETS:
        sums += offset * y_chunk
    return tl.sum(sums, axis=1)


@triton.jit
def _x_at(x_row, perm_ptr, nw_ptr, cols, in_k, K, HAS_PERM: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr):
    """(x, x * norm weight) of one row at packed columns `cols`, fp32 (x twice without NORM)."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols, mask=in_k, other=0)
    x = _load_x(x_row, cols, in_k, K, GATED)
    if NORM:
        return x, x * tl.load(nw_ptr + cols, mask=in_k, other=0.0).to(tl.float32)
    return x, x


@triton.jit
def _scaled_chunk_sums(x, w, scale, offset, HAS_OFFSETS: tl.constexpr):
    """One row: sum over chunks of scale * sum(x * w) (+ offset * sum(x)): x [NC, CH], w [BN, NC, CH],
    scale and offset [BN, NC] -> [BN]."""
    sums = tl.sum(w * x[None, :, :], axis=2) * scale  # [BN, NC]
    if HAS_OFFSETS:
        sums += offset * tl.sum(x, axis=1)[None, :]
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
    in x's dtype, fp32 accumulation. Arguments are checked by `quant_matmul`, the entry point."""
    num_rows = x.shape[0]
    n, k = w.shape
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    tiles = quant_gemv_config(n, gated)
    block_n = block_n or tiles["block_n"]
    block_k, chunking = tile_for(w, block_k or tiles["block_k"])
    opts = {} if is_interpreter() else {"num_warps": num_warps or tiles["num_warps"],
                                        "num_stages": num_stages or tiles["num_stages"]}
    args, consts = kernel_args(w)
    _quant_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w.perm if w.perm is not None else x, bias if bias is not None else x,
        norm_weight if norm_weight is not None else x, residual if residual is not None else x, out, *args,
        num_rows, n, k, eps, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), **consts,
        HAS_PERM=w.perm is not None, HAS_BIAS=bias is not None, GATED=gated, NORM=norm_weight is not None,
        RESIDUAL=residual is not None, BLOCK_M=next_pow2(num_rows), BLOCK_N=block_n, BLOCK_K=block_k, **chunking,
        **opts, **pdl_args(x.device))
    return out
