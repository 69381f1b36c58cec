"""Weight-only quantized skinny matmul for decode: y = x @ dequant(w).T with 1..16 rows of x.

At decode batch sizes a linear layer is bound by reading its weight; a packed weight is 2-4x fewer
bytes. Each program owns BLOCK_N output columns for every row of x and streams its rows of the packed
weight once. Reading 4-bit weights at full bandwidth leaves a few instructions a weight, so the kernel
keeps the per-weight work to integer ops, one subtraction and one multiply-add:

- a code q becomes a float without a conversion instruction (those run at a fraction of the FMA rate):
  the bits of (q | 0x4B000000) are the float 2**23 + q, and subtracting 2**23 + zero leaves q - zero
  exactly (both are integers below 2**24);
- scales, zeros and offsets are per group: each K tile is cut into chunks of one group each
  ([BLOCK_N, NUM_CHUNKS, CHUNK]), the products are summed within a chunk and scaled once per chunk,
  so w = s * (q - z) + o costs s * sum(x * (q - z)) + o * sum(x) per group instead of per weight.

Within each 32 columns byte j holds columns j and j + 16 (`quant_layout`), so a tile is two planes
(lo: columns j, hi: columns j + 16) multiplied by two strided views of x. Results equal
dequantize-then-matmul up to fp32 summation order.

The fused decoder's options are those of `kernels.gemv`: `gated` (x = [gate | up], the input is
silu(gate) * up), `norm_weight` (the input is rms_norm(x) * norm_weight: the sums of squares ride along
the K loop and scale the sums at the end) and `residual` (added to the output before rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import cast, is_interpreter, next_pow2, pdl_args, pdl_enter
from kernels.quant_layout import NIBBLE_SPAN, IntPackedWeight, kernel_args, next_tile_k

MAX_QUANT_GEMV_ROWS = 16  # more rows go to `quant_gemm` (tensor cores)
FLOAT_MAGIC = 0x4B000000  # the bits of 2.0 ** 23: OR-ing an integer below 2**23 into it adds it


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
    # A tile's plane of BLOCK_K / 2 columns is NUM_CHUNKS chunks of CHUNK columns, one group each:
    # chunk c of plane lo is group k0 // GROUP + c * GROUP_STEP, of plane hi that + HI_GROUP.
    NUM_CHUNKS: tl.constexpr = BLOCK_K // 2 // CHUNK
    pdl_enter(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm  # [BM, 1]
    b = tl.arange(0, BLOCK_K // 2)
    chunks = tl.arange(0, NUM_CHUNKS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols_lo = k0 + (b // 16) * 32 + b % 16  # [BK/2]
        cols_hi = cols_lo + 16
        in_k = cols_lo < K  # K % 32 == 0: cols_hi < K alike
        w_mask = n_mask[:, None] & in_k[None, :]
        q_lo, q_hi = _load_codes(qs_ptr, qh_ptr, rows, k0, b, cols_lo, cols_hi, w_mask, stride_qs, stride_qh,
                                 BITS, BLOCK_K)
        group_lo = k0 // GROUP + chunks * GROUP_STEP  # [NC]
        in_groups = (k0 + chunks * (2 * CHUNK)) < K
        zf_lo, s_lo, o_lo = _group_params(z_ptr, s_ptr, o_ptr, rows, group_lo, n_mask, in_groups, stride_s,
                                          ZERO, HAS_ZEROS, HAS_OFFSETS)
        if HI_GROUP == 0:
            zf_hi = zf_lo
            s_hi = s_lo
            o_hi = o_lo
        else:
            zf_hi, s_hi, o_hi = _group_params(z_ptr, s_ptr, o_ptr, rows, group_lo + HI_GROUP, n_mask, in_groups,
                                              stride_s, ZERO, HAS_ZEROS, HAS_OFFSETS)
        # q - zero, exactly, as fp32 [BN, NC, CHUNK]
        w_lo = tl.reshape((q_lo | FLOAT_MAGIC).to(tl.float32, bitcast=True), (BLOCK_N, NUM_CHUNKS, CHUNK))
        w_hi = tl.reshape((q_hi | FLOAT_MAGIC).to(tl.float32, bitcast=True), (BLOCK_N, NUM_CHUNKS, CHUNK))
        w_lo = w_lo - zf_lo[:, :, None]
        w_hi = w_hi - zf_hi[:, :, None]
        if HAS_PERM:
            cols_lo = tl.load(perm_ptr + cols_lo, mask=in_k, other=0)
            cols_hi = tl.load(perm_ptr + cols_hi, mask=in_k, other=0)
        x_mask = (offs_m[:, None] < M) & in_k[None, :]
        x_lo = _load_x(x_rows, cols_lo, x_mask, K, GATED)  # [BM, BK/2] fp32
        x_hi = _load_x(x_rows, cols_hi, x_mask, K, GATED)
        if NORM:
            squares += tl.sum(x_lo * x_lo, axis=1) + tl.sum(x_hi * x_hi, axis=1)
            x_lo *= tl.load(nw_ptr + cols_lo, mask=in_k, other=0.0).to(tl.float32)[None, :]
            x_hi *= tl.load(nw_ptr + cols_hi, mask=in_k, other=0.0).to(tl.float32)[None, :]
        x_lo = tl.reshape(x_lo, (BLOCK_M, NUM_CHUNKS, CHUNK))
        x_hi = tl.reshape(x_hi, (BLOCK_M, NUM_CHUNKS, CHUNK))
        acc += _scaled_chunk_sums(x_lo, w_lo, s_lo, o_lo, BLOCK_M, HAS_OFFSETS)
        acc += _scaled_chunk_sums(x_hi, w_hi, s_hi, o_hi, BLOCK_M, HAS_OFFSETS)
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
def _load_codes(qs_ptr, qh_ptr, rows, k0, b, cols_lo, cols_hi, mask, stride_qs, stride_qh,
                BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The unsigned codes of columns cols_lo and cols_hi of `rows`, as int32 [BN, BK/2] each."""
    if BITS == 8:
        q_lo = tl.load(qs_ptr + rows[:, None] * stride_qs + cols_lo[None, :], mask=mask, other=0).to(tl.int32)
        q_hi = tl.load(qs_ptr + rows[:, None] * stride_qs + cols_hi[None, :], mask=mask, other=0).to(tl.int32)
    else:
        byte = tl.load(qs_ptr + rows[:, None] * stride_qs + (k0 // 2 + b)[None, :], mask=mask, other=0).to(tl.int32)
        q_lo = byte & 15
        q_hi = byte >> 4
        if BITS > 4:
            HB: tl.constexpr = BITS - 4
            PER: tl.constexpr = 8 // HB
            h_lo = tl.load(qh_ptr + rows[:, None] * stride_qh + (cols_lo // PER)[None, :], mask=mask, other=0)
            h_hi = tl.load(qh_ptr + rows[:, None] * stride_qh + (cols_hi // PER)[None, :], mask=mask, other=0)
            q_lo = q_lo | (((h_lo.to(tl.int32) >> ((cols_lo % PER) * HB)[None, :]) & ((1 << HB) - 1)) << 4)
            q_hi = q_hi | (((h_hi.to(tl.int32) >> ((cols_hi % PER) * HB)[None, :]) & ((1 << HB) - 1)) << 4)
    return q_lo, q_hi


@triton.jit
def _group_params(z_ptr, s_ptr, o_ptr, rows, groups, n_mask, in_groups, stride_s,
                  ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_OFFSETS: tl.constexpr):
    """For `groups` [NC] of `rows` [BN]: (2**23 + zero, scale, offset), each fp32 [BN, NC]."""
    mask = n_mask[:, None] & in_groups[None, :]
    at = rows[:, None] * stride_s + groups[None, :]
    scale = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + at, mask=mask, other=0).to(tl.float32) + 8388608.0
    else:
        zero = tl.zeros_like(scale) + (ZERO + 8388608.0)
    if HAS_OFFSETS:
        offset = tl.load(o_ptr + at, mask=mask, other=0.0).to(tl.float32)
    else:
        offset = scale
    return zero, scale, offset


@triton.jit
def _scaled_chunk_sums(x, w, scale, offset, BLOCK_M: tl.constexpr, HAS_OFFSETS: tl.constexpr):
    """sum over chunks of scale * sum(x * w) (+ offset * sum(x)): x [BM, NC, CH], w [BN, NC, CH],
    scale and offset [BN, NC] -> [BM, BN]."""
    if BLOCK_M == 1:
        x1 = tl.reshape(x, (x.shape[1], x.shape[2]))
        sums = tl.sum(w * x1[None, :, :], axis=2) * scale  # [BN, NC]
        if HAS_OFFSETS:
            sums += offset * tl.sum(x1, axis=1)[None, :]
        return tl.reshape(tl.sum(sums, axis=1), (1, w.shape[0]))
    sums = tl.sum(x[:, None, :, :] * w[None, :, :, :], axis=3) * scale[None, :, :]  # [BM, BN, NC]
    if HAS_OFFSETS:
        sums += offset[None, :, :] * tl.sum(x, axis=2)[:, None, :]
    return tl.sum(sums, axis=2)


@triton.jit
def _load_x(x_rows, cols, mask, K, GATED: tl.constexpr):
    """Columns `cols` of the rows of x, in fp32: x itself, or silu(gate) * up of x = [gate | up]."""
    if GATED:
        gate = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return gate * tl.sigmoid(gate) * up
    return tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)


def quant_gemv_config(num_rows: int, n: int) -> dict:
    """Tiles (a first guess for the GPU; `bench/gpu_quant.py --sweep` measures them): output columns a
    program as `gemv` picks them (enough programs to fill the SMs, fewer columns the wider the layer),
    and a K tile that keeps the BLOCK_M x BLOCK_N x BLOCK_K / 2 products of one step near 4096."""
    block_m = next_pow2(num_rows)
    block_n = 4 if n >= 16384 else 8 if n >= 6144 else 16
    block_k = max(64, min(1024, 8192 // (block_m * block_n)))
    return {"block_n": block_n, "block_k": block_k, "num_warps": 8 if block_k >= 512 else 4, "num_stages": 3}


def group_chunks(group_size: int, k: int, block_k: int) -> tuple[int, dict]:
    """The K tile and its chunking for a group size: (block_k, {CHUNK, GROUP_STEP, HI_GROUP}).

    One group a tile (per channel, or groups wider than the tile: a tile must not straddle two);
    several groups of 32 or more (a group's lo and hi columns share it); groups of 16 (in each 32
    columns, lo is one group and hi the next)."""
    if group_size == 16:
        return block_k, {"CHUNK": 16, "GROUP_STEP": 2, "HI_GROUP": 1}
    if group_size < k and block_k % group_size == 0:
        return block_k, {"CHUNK": group_size // 2, "GROUP_STEP": 1, "HI_GROUP": 0}
    if group_size < k:  # a tile within one group: the largest power of two dividing it
        block_k = min(block_k, group_size & -group_size)
    return block_k, {"CHUNK": block_k // 2, "GROUP_STEP": 1, "HI_GROUP": 0}


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
    tiles = quant_gemv_config(num_rows, n)
    block_n = block_n or tiles["block_n"]
    block_k, chunking = group_chunks(w.group_size, k, next_tile_k(k, block_k or tiles["block_k"]))
    assert block_k % NIBBLE_SPAN == 0, block_k
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
