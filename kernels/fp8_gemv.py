"""Weight-only fp8 matmul for batch-1 decode: y = x @ dequant(w).T with one row of x (it takes a few).

At decode batch sizes an fp8 linear layer is bound by reading its e4m3 weight (half the bytes of
bf16). `fp8_gemm` would first quantize the activations (a handful of small launches per layer, which
cost more than the matmul at one row); here x stays in its dtype, so the result is the exact
dequantize-then-matmul up to fp32 summation order, more accurate than the fp8 x fp8 product.

e4m3 becomes fp32 without a conversion instruction (those run at a fraction of the FMA rate): its
bits moved into an fp32's sign, exponent and mantissa make the same number times 2**-120 (the bias
difference, 127 - 7): two integer ops, the 2**120 carried by x (2**40) and the scales (2**80) instead
of a multiply a weight. Scales apply once per scale block:
a K tile lies within one block, or (one row of x, blocks a power of two wide) covers several, whose
products are summed block by block before their scales apply ([128, 128] blocks would otherwise cap
the tile at 128 bytes a weight row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import cast, interpreted_block_n, is_interpreter, next_pow2, pdl_args, pdl_enter

MAX_FP8_GEMV_ROWS = 1  # more rows go to the fp8 x fp8 GEMM, faster there (bench/gpu_quant.py --only crossover)


# NOTE: e4m3 decoded by bit moves is the code's value times 2**-120. Rather than a multiply a weight, x is
# scaled by 2**40 (once a tile, shared by its columns) and the scales by 2**80, both exact: the products
# (value * x * 2**-80) stay normal floats for |value * x| >= 2**-46, and a group's sum is a chain of
# multiply-adds.
X_SCALE: tl.constexpr = tl.constexpr(1099511627776.0)  # 2**40
W_SCALE: tl.constexpr = tl.constexpr(1.2089258196146292e24)  # 2**80


@triton.jit
def e4m3_bits_scaled(code):
    """e4m3 codes (int32 holding the raw byte in its low 8 bits) -> their exact values times 2**-120, fp32."""
    # The byte to the top, then arithmetically 4 back: the sign stays in bit 31, the exponent and
    # mantissa land in fp32's bits 23-26 and 20-22. That float is the code's value * 2**-120 (subnormal
    # codes included, as fp32 subnormals).
    bits = ((code << 24) >> 4) & -2014314496  # 0x87F00000: sign, 4 exponent and 3 mantissa bits
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [M, K] activations
    w_ptr,  # [N, K] e4m3, read as uint8
    s_ptr,  # [cdiv(N, GROUP_N), cdiv(K, GROUP_K)] float32
    b_ptr,  # [N] bias, or any pointer when not HAS_BIAS
    r_ptr,  # [M, N] residual, or any pointer when not RESIDUAL
    y_ptr,  # [M, N]
    M, N, K, stride_xm, stride_wn, stride_s, stride_rm, stride_ym,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS_PER_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    s_rows = s_ptr + (offs_n // GROUP_N) * stride_s
    # NOTE: no earlier kernel writes the weight, so the first tile is read before the PDL wait: a program
    # scheduled while the previous kernel's last ones still run has its first codes in flight meanwhile.
    code = _load_codes(w_rows, offs_k, K, n_mask)
    pdl_enter(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate(acc, code, x_rows, s_rows, 0, offs_k, K, m_mask, n_mask, GROUP_K, BLOCK_M, BLOCK_N,
                      GROUPS_PER_TILE)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        code = _load_codes(w_rows, k0 + offs_k, K, n_mask)
        acc = _accumulate(acc, code, x_rows, s_rows, k0, offs_k, K, m_mask, n_mask, GROUP_K, BLOCK_M, BLOCK_N,
                          GROUPS_PER_TILE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    if RESIDUAL:
        acc += tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=y_mask,
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], cast(acc, y_ptr.dtype.element_ty),
             mask=y_mask)


@triton.jit
def _load_codes(w_rows, k, K, n_mask):
    """The e4m3 codes of columns k of the program's rows, as int32 [BN, BK]."""
    return tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0).to(tl.int32)


@triton.jit
def _accumulate(acc, code, x_rows, s_rows, k0, offs_k, K, m_mask, n_mask, GROUP_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_TILE: tl.constexpr):
    """acc [BM, BN] plus the K tile at k0: its codes [BN, BK] times x's columns, scaled by their blocks' scales."""
    k = k0 + offs_k
    w = e4m3_bits_scaled(code)  # [BN, BK] value * 2**-120
    x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32) * X_SCALE
    if GROUPS_PER_TILE > 1:  # one row of x; the tile's scale blocks summed one by one
        groups = k0 // GROUP_K + tl.arange(0, GROUPS_PER_TILE)
        scales = tl.load(s_rows[:, None] + groups[None, :], mask=n_mask[:, None] & (groups * GROUP_K < K)[None, :],
                         other=0.0) * W_SCALE  # [BN, G]
        sums = tl.sum(tl.reshape(w * x, (BLOCK_N, GROUPS_PER_TILE, GROUP_K)), axis=2)  # [BN, G]
        return acc + tl.reshape(tl.sum(sums * scales, axis=1), (1, BLOCK_N))
    scale = tl.load(s_rows + k0 // GROUP_K, mask=n_mask, other=0.0) * W_SCALE  # [BN]
    if BLOCK_M == 1:
        part = tl.reshape(tl.sum(w * x, axis=1), (1, BLOCK_N))
    else:
        part = tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # [BM, BN]
    return acc + part * scale[None, :]


def fp8_gemv_config(num_rows: int, n: int, is_k_blocked: bool = False) -> dict:
    """Tiles measured best at one row (`bench/gpu_quant.py --sweep`, Llama-3-8B's projections, 2026-11-26):
    per-channel scales take 4 columns a program on 4 warps and a 2048-wide K tile: in the decode step (CUDA
    graphs, PDL) that beat the 8 x 1024 tiles each projection measured best alone (H200, served batch 1, 2026-11-28:
    262.6 -> 288.7 tok/s; 8 x 2048 282.3, 4 x 4096 286.6, 8 x 1024 on 2 warps 267.7). Scales in [128, 128]
    blocks, with K tiles spanning several blocks at one row: 1024-wide K tiles on 4 warps, 16 columns on the wide
    layers (qkv, gate_up) and 4 on the narrow ones (H200: gate_up 0.41 -> 2.61, qkv 0.95 -> 1.92, o 1.21 -> 1.49,
    down 1.36 -> 1.75 TB/s against the 8-warp tiles made for K tiles inside a block; not measured in the step).
    More rows narrow the K tile, keeping the products of a step in the register budget."""
    block_m = next_pow2(num_rows)
    if is_k_blocked:
        block_n, num_warps = (16 if n >= 6144 else 4), 4
        block_k = max(64, min(1024, 16384 // (block_m * block_n)))
        return {"block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": 3}
    block_n, num_warps = 4, 4
    block_k = max(64, min(2048, 8192 // (block_m * block_n)))
    return {"block_n": block_n, "block_k": block_k, "num_warps": num_warps, "num_stages": 3}


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int,
             bias: torch.Tensor | None = None, *, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None, tile_n: int | None = None, tile_k: int | None = None,
             num_warps: int | None = None) -> torch.Tensor:
    """x [M, K] (a few rows; `fp8_linear` sends up to MAX_FP8_GEMV_ROWS) @ (weight * scale blocks).T
    + bias (+ residual) -> [M, N] in x's dtype, fp32 accumulation. `weight` e4m3 [N, K], `scale` float32 per
    [block_n, block_k] block. Arguments are checked by `fp8_linear`, the entry point. `weight` is read before
    the PDL wait (kernels/README.md)."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    tiles = fp8_gemv_config(num_rows, n, is_k_blocked=block_k < k)
    tile_k = max(16, min(tile_k or tiles["block_k"], triton.next_power_of_2(k)))
    groups_per_tile = 1
    if block_k < k:
        if num_rows == 1 and block_k & (block_k - 1) == 0 and tile_k > block_k:
            groups_per_tile = tile_k // block_k  # whole scale blocks a tile (both powers of two)
        else:  # a tile within one scale block: the largest power of two dividing it
            tile_k = min(tile_k, block_k & -block_k)
    tile_n = tile_n or interpreted_block_n(tiles["block_n"], n)
    opts = {} if is_interpreter() else {"num_warps": num_warps or tiles["num_warps"], "num_stages": tiles["num_stages"]}
    _fp8_gemv_kernel[(triton.cdiv(n, tile_n),)](
        x, weight.view(torch.uint8), scale, bias if bias is not None else x, residual if residual is not None else x,
        out, num_rows, n, k, x.stride(0), weight.stride(0), scale.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), GROUP_N=block_n, GROUP_K=block_k,
        HAS_BIAS=bias is not None, RESIDUAL=residual is not None, BLOCK_M=next_pow2(num_rows),
        BLOCK_N=tile_n, BLOCK_K=tile_k, GROUPS_PER_TILE=groups_per_tile, **opts,
        **pdl_args(x.device))
    return out
