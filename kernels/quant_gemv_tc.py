"""The decode GEMV for 4-bit codes on the tensor cores: y = x @ dequant(w).T with 1..16 rows of x, and the
same kernel over row blocks of x for larger batches (`block_m` rows a program).

The CUDA-core GEMV (`quant_gemv`) spends ~6 instructions a weight (nibble extraction, conversion, one
multiply-add, the per-group reductions), so on a Hopper it issues instructions at its limit while memory
delivers half of what it could. Here the multiply-adds go to the tensor cores, which are idle at decode
sizes, and a weight costs ~1.75 instructions (shared-memory load included; 2.9-3.5 a weight in the whole SASS
loop against 6.3):

- the kernel computes y^T = w @ x^T, the weight as the MMA's A operand (taken from registers: it is
  widened there) and x^T, padded to 16 columns (or a block of `block_m` rows), as B;
- two bytes (four codes) become two bf16x2 (fp16x2) registers in four instructions: the bytes spread
  into the low bytes of both halves of a word (`prmt`), each nibble OR-ed into the mantissa of MAGIC
  (`lop3`; 128 in bf16, 1024 in fp16, whose unit in the last place is 1), so a register holds
  MAGIC + q exactly, no conversion instruction;
- the zero (constant or per group) is subtracted in packed half-precision, two weights an instruction:
  MAGIC + q - (MAGIC + z) is q - z exactly;
- a sub-tile's two planes (low nibbles, high nibbles) are joined in registers into one MMA, x^T loaded in the
  same column order, so each sub-tile waits for one MMA;
- products of 16-bit values are exact in the fp32 accumulator; each group's sum is scaled once (a K
  tile of 128 columns steps through sub-tiles of one group each: one for groups of 128, four for GGUF
  Q4_0's 32). So results equal dequantize-then-matmul up to fp32 summation order;
- in row blocks of more than SCALED_PAST_ROWS rows (`SCALED`) the weight is scaled in x's dtype before the
  MMA instead, rounded as the tensor-core GEMM (`quant_layout.half_planes`) rounds it: scaling after the MMA
  costs BM multiply-adds a weight row and K step (scaling before: BK / 2) and makes every MMA wait for the
  previous one's result, where chained on one accumulator they overlap the widening;
- the codes may sit in row tiles (`quant_tiles.with_row_tiles`, what the loader does on the GPU): a
  program's K step then reads one contiguous run.

Narrow layers split K over several programs (`SPLIT_K`, `kernels.split_k`): the program that finishes a
column tile last sums the fp32 partials in a fixed order, deterministically, and applies the epilogue.

The fused decoder's options are those of `kernels.gemv` (`gated`, `norm_weight`, `residual`); the
input then passes through the same fp32 prologue and is rounded to x's dtype once, as the unfused layers
round it (on all 16 padded rows: a narrower layout would cost the loads their pipelining).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    _INTERPRETED,
    cast,
    compute_capability,
    is_interpreter,
    mma,
    pdl_args,
    pdl_enter,
)
from kernels.quant_gemv_tc_tiles import MAX_ROWS, quant_gemv_tc_config
from kernels.quant_layout import IntPackedWeight, _magic_plus
from kernels.split_k import arrive, sum_partials, workspace

# Row blocks wider than this scale the weight before the MMA (an H100, 2026-11-28: 64-row blocks faster scaling
# after it, e.g. qkv at 64 rows 21.2 against 26.7 us; 256-row blocks faster before, gate_up at 256 rows 164.9 us
# against 190.8 for the best tile scaling after)
SCALED_PAST_ROWS = 64


# two bytes (in the low half of $2) -> MAGIC + each low nibble ($0) and each high nibble ($1), MAGIC_BITS two
# 16-bit floats of MAGIC (0x4300: 128 in bf16; 0x6400: 1024 in fp16); lop3 0xEA is (a & b) | c
_WIDEN_ASM = """{
    .reg .b32 t;
    prmt.b32 t, $2, 0, 0x4140;
    lop3.b32 $0, t, 0x000F000F, MAGIC_BITS, 0xEA;
    shr.u32 t, t, 4;
    lop3.b32 $1, t, 0x000F000F, MAGIC_BITS, 0xEA;
    }"""
WIDEN_BF16 = tl.constexpr(_WIDEN_ASM.replace("MAGIC_BITS", "0x43004300"))
WIDEN_FP16 = tl.constexpr(_WIDEN_ASM.replace("MAGIC_BITS", "0x64006400"))


@triton.jit
def _magic_codes(byte, ACT: tl.constexpr):
    """uint8 [BN, BK/2] -> (MAGIC + low nibble, MAGIC + high nibble), each ACT [BN, BK/2]."""
    if _INTERPRETED:
        code = byte.to(tl.int16)
        return _magic_plus(code & 15, ACT), _magic_plus(code >> 4, ACT)
    elif ACT == tl.bfloat16:
        return tl.inline_asm_elementwise(WIDEN_BF16, "=r,=r,r", [byte], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=2)
    else:
        return tl.inline_asm_elementwise(WIDEN_FP16, "=r,=r,r", [byte], dtype=(tl.float16, tl.float16), is_pure=True,
                                         pack=2)


@triton.jit
def _minus(a, b):
    """a - b in a's dtype (exact here: integers below 256)."""
    if _INTERPRETED:  # NOTE: the interpreter has no bf16 arithmetic
        return (a.to(tl.float32) - b.to(tl.float32)).to(a.dtype)
    else:
        return a - b


@triton.jit
def _x_planes(x_ptr, nw_ptr, perm_ptr, cols, offs_m, M, K, stride_xm, squares,
              GATED: tl.constexpr, NORM: tl.constexpr, HAS_PERM: tl.constexpr, ACT: tl.constexpr):
    """x^T at columns `cols` [C] through the fused prologue: (ACT [C, BM], squares + this tile's sum of x^2 per
    row [BM])."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols)
    at = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + cols[:, None]
    mask = offs_m[None, :] < M
    xt = tl.load(at, mask=mask, other=0.0).to(tl.float32)  # [BK/2, 16]
    if GATED:
        up = tl.load(at + K, mask=mask, other=0.0).to(tl.float32)
        xt = xt * tl.sigmoid(xt) * up
    if NORM:
        squares += tl.sum(xt * xt, axis=0)
        xt = xt * tl.load(nw_ptr + cols).to(tl.float32)[:, None]
    return cast(xt, ACT), squares


@triton.jit
def _scaled(magic, magic_zero, scale):
    """(MAGIC + q) - (MAGIC + z), times the scale (ACT [BN, 1]), rounded once to ACT: `quant_layout.half_planes`'s
    weight, what the tensor-core GEMM multiplies."""
    if _INTERPRETED:  # NOTE: the interpreter has no bf16 arithmetic: the same roundings in fp32
        return cast((magic.to(tl.float32) - magic_zero.to(tl.float32)) * scale.to(tl.float32), magic.dtype)
    else:
        return (magic - magic_zero) * scale


@triton.jit
def _sub_tile(acc, x_ptr, perm_ptr, nw_ptr, q_at, s_ptr, z_ptr, rows, c0, offs_m, M, K, stride_s, stride_xm,
              squares, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
              GATED: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
              SUB_K: tl.constexpr, SCALED: tl.constexpr, MAGIC: tl.constexpr, ACT: tl.constexpr):
    """acc [BN, BM] + columns c0 .. c0 + SUB_K (inside one group) of rows `rows`, their bytes at `q_at`
    [BN, SUB_K/2]: (acc + scale * sum(x * (q - z)), squares). SCALED: the weight scaled in ACT before the MMA
    instead (rounded as the GEMM rounds it), so the MMAs chain on acc with no fp32 work between them."""
    byte = tl.load(q_at)  # [BN, SUB_K/2] uint8
    w_lo, w_hi = _magic_codes(byte, ACT)
    group = c0 // GROUP
    if HAS_ZEROS:
        zero = _magic_plus(tl.load(z_ptr + rows * stride_s + group).to(tl.int16), ACT)[:, None]
    else:
        zero = tl.full((BLOCK_N, 1), MAGIC + ZERO, ACT)
    scale = tl.load(s_ptr + rows * stride_s + group).to(tl.float32)[:, None]
    if SCALED:
        b = tl.arange(0, SUB_K // 2)
        plane_cols = (b // 16) * 32 + b % 16  # plane lo's columns; plane hi's are 16 further
        x_lo, squares = _x_planes(x_ptr, nw_ptr, perm_ptr, c0 + plane_cols, offs_m, M, K, stride_xm, squares,
                                  GATED, NORM, HAS_PERM, ACT)
        x_hi, squares = _x_planes(x_ptr, nw_ptr, perm_ptr, c0 + 16 + plane_cols, offs_m, M, K, stride_xm, squares,
                                  GATED, NORM, HAS_PERM, ACT)
        acc = mma(_scaled(w_lo, zero, cast(scale, ACT)), x_lo, acc, "tf32", _INTERPRETED)
        return mma(_scaled(w_hi, zero, cast(scale, ACT)), x_hi, acc, "tf32", _INTERPRETED), squares
    # NOTE: both planes in one MMA of SUB_K columns (plane lo's, then plane hi's), one wait a sub-tile, not two
    w = tl.reshape(tl.permute(tl.join(_minus(w_lo, zero), _minus(w_hi, zero)), (0, 2, 1)), (BLOCK_N, SUB_K))
    kk = tl.arange(0, SUB_K)  # -> plane_cols, then 16 + plane_cols
    cols = ((kk // 16) % (SUB_K // 32)) * 32 + (kk // (SUB_K // 2)) * 16 + kk % 16
    xt, squares = _x_planes(x_ptr, nw_ptr, perm_ptr, c0 + cols, offs_m, M, K, stride_xm, squares, GATED, NORM,
                            HAS_PERM, ACT)
    part = mma(w, xt, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), "tf32", _INTERPRETED)
    return acc + part * scale, squares


@triton.jit
def _k_tile(acc, x_ptr, perm_ptr, nw_ptr, q_at, s_ptr, z_ptr, rows, k0, offs_m, M, K, stride_s, stride_xm, squares,
            GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
            GATED: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, SCALED: tl.constexpr, MAGIC: tl.constexpr,
            ACT: tl.constexpr):
    """acc + columns k0 .. k0 + BLOCK_K of rows `rows` in sub-tiles of SUB_K columns, each inside one group
    (groups of 32 take four a 128-wide tile): (acc fp32 [BN, BM], squares)."""
    for j in tl.static_range(0, BLOCK_K // SUB_K):
        acc, squares = _sub_tile(acc, x_ptr, perm_ptr, nw_ptr, q_at + j * (SUB_K // 2), s_ptr, z_ptr, rows,
                                 k0 + j * SUB_K, offs_m, M, K, stride_s, stride_xm, squares, GROUP, ZERO, HAS_ZEROS,
                                 HAS_PERM, GATED, NORM, BLOCK_N, BLOCK_M, SUB_K, SCALED, MAGIC, ACT)
    return acc, squares


@triton.jit
def _quant_gemv_tc_kernel(
    x_ptr,  # [M, K] activations ([M, 2K] when GATED)
    perm_ptr,  # [K] int32 packed column -> x column, or any pointer when not HAS_PERM
    b_ptr,  # [N] bias, or any pointer when not HAS_BIAS
    nw_ptr,  # [K] RMSNorm weight, or any pointer when not NORM
    r_ptr,  # [M, N] residual, or any pointer when not RESIDUAL
    y_ptr,  # [M, N]
    ws_ptr,  # [SPLIT_K, M_pad, N] fp32 partials (zero), or any pointer when SPLIT_K == 1
    count_ptr,  # [row blocks, cdiv(N, BLOCK_N)] int32 arrivals (zero), or any pointer when SPLIT_K == 1
    qs_ptr, s_ptr, z_ptr, stride_qs, stride_s,  # the packed weight (4-bit codes, no offsets)
    M, N, K, eps, stride_xm, stride_rm, stride_ym,
    GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr,
    SPLIT_K: tl.constexpr, SCALED: tl.constexpr, USE_PDL: tl.constexpr, TILE_N: tl.constexpr,
):
    ACT: tl.constexpr = x_ptr.dtype.element_ty
    MAGIC: tl.constexpr = 128.0 if ACT == tl.bfloat16 else 1024.0
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N read row N - 1 and are never stored
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = tl.arange(0, SUB_K // 2)  # a sub-tile's bytes in a row (`_k_tile` steps through the K tile's)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    k_split = tl.cdiv(K // BLOCK_K, SPLIT_K) * BLOCK_K  # K is a multiple of BLOCK_K
    k_begin = tl.multiple_of(tl.program_id(1) * k_split, BLOCK_K)
    if TILE_N == 0:  # the byte offset of each row's K step 0 (`quant_tiles.qs_offsets`, hoisted)
        q_rows = rows * stride_qs
    else:
        q_rows = (rows // TILE_N) * (TILE_N * stride_qs) + (rows % TILE_N) * 64  # 64: quant_tiles.TILE_BYTES
    for k0 in range(k_begin, tl.minimum(k_begin + k_split, K), BLOCK_K):
        if TILE_N == 0:
            q_at = qs_ptr + q_rows[:, None] + (k0 // 2 + b)[None, :]
        elif BLOCK_K == 128:  # a K step is one tile (64 bytes a row); NOTE: without the `% 64` term Triton
            # keeps the 16-byte alignment and the loads stay asynchronous copies (the general form: byte loads)
            q_at = qs_ptr + q_rows[:, None] + (k0 // 128) * (TILE_N * 64) + b[None, :]
        else:  # BLOCK_K < 128: a K step stays inside one tile
            q_at = qs_ptr + q_rows[:, None] + (k0 // 128) * (TILE_N * 64) + (k0 // 2) % 64 + b[None, :]
        acc, squares = _k_tile(acc, x_ptr, perm_ptr, nw_ptr, q_at, s_ptr, z_ptr, rows, k0, offs_m, M, K, stride_s,
                               stride_xm, squares, GROUP, ZERO, HAS_ZEROS, HAS_PERM, GATED, NORM, BLOCK_N, BLOCK_M,
                               BLOCK_K, SUB_K, SCALED, MAGIC, ACT)
    if SPLIT_K > 1:
        slab = tl.num_programs(2) * BLOCK_M * N  # one split's [M_pad, N] partials
        ws_at = offs_m[None, :] * N + offs_n[:, None]  # [BN, BM]
        # NOTE: the rows of x only (a decode call's one row of 16 padded: 1/16 of the traffic)
        ws_mask = n_mask[:, None] & (offs_m[None, :] < M)
        tile = tl.program_id(2) * tl.num_programs(0) + pid_n  # this output tile's counter
        arrived = arrive(acc, ws_ptr, count_ptr, ws_at, ws_mask, slab, tile, pid_n)
        if arrived == SPLIT_K - 1:  # the last program of this output tile: sum and finish
            acc = sum_partials(ws_ptr, count_ptr, ws_at, ws_mask, slab, tile, pid_n, SPLIT_K, BLOCK_N, BLOCK_M)
            if NORM:  # every program saw only its K range of x: the norm's sums again, whole
                squares = _row_squares(x_ptr, offs_m, M, K, stride_xm, BLOCK_M)
            _finish(acc, squares, b_ptr, r_ptr, y_ptr, offs_n, n_mask, offs_m, M, K, eps, stride_rm, stride_ym,
                    HAS_BIAS, NORM, RESIDUAL)
    else:
        _finish(acc, squares, b_ptr, r_ptr, y_ptr, offs_n, n_mask, offs_m, M, K, eps, stride_rm, stride_ym,
                HAS_BIAS, NORM, RESIDUAL)


@triton.jit
def _row_squares(x_ptr, offs_m, M, K, stride_xm, BLOCK_M: tl.constexpr):
    """Sum of x^2 over each row's K columns [BM] (the RMSNorm's), in chunks of 1024."""
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    cols = tl.arange(0, 1024)
    for k0 in range(0, K, 1024):
        x = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k0 + cols)[:, None],
                    mask=(offs_m[None, :] < M) & (k0 + cols < K)[:, None], other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=0)
    return squares


@triton.jit
def _finish(acc, squares, b_ptr, r_ptr, y_ptr, offs_n, n_mask, offs_m, M, K, eps, stride_rm, stride_ym,
            HAS_BIAS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr):
    """y^T tile [BN, BM] = acc (/ rms) (+ bias) (+ residual), rounded to y's dtype, rows < M stored."""
    if NORM:
        acc = acc / tl.sqrt(squares / K + eps)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    mask = n_mask[:, None] & (offs_m[None, :] < M)
    rows = offs_m[None, :].to(tl.int64)
    if RESIDUAL:
        acc += tl.load(r_ptr + rows * stride_rm + offs_n[:, None], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows * stride_ym + offs_n[:, None], cast(acc, y_ptr.dtype.element_ty), mask=mask)


def takes_tensor_cores(w: IntPackedWeight, x: torch.Tensor) -> bool:
    """Whether `quant_gemv_tc` takes this weight and input: 4-bit codes without offsets in groups of 32 columns
    or more (a K sub-tile never spans two), fp16 / bf16 activations on a GPU with bf16 MMA (or the interpreter).

    NOTE: offsets (GGUF Q4_1, Q4_K: w = scale * q + offset) were taken with each group's sum of x from a small
    kernel and measured slower than the GEMM at 16 rows (H100, all layers: Q4_K 7.60 against 6.47 ms)."""
    n, k = w.shape
    return (w.bits == 4 and w.offsets is None and x.dtype in (torch.float16, torch.bfloat16)
            and w.group_size >= 32 and k % 32 == 0 and (w.group_size == k or w.group_size % 32 == 0)
            and (is_interpreter() or (x.is_cuda and compute_capability(x.device) >= (8, 0))))


def quant_gemv_tc(x: torch.Tensor, w: IntPackedWeight, bias: torch.Tensor | None = None, *, gated: bool = False,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
                  out: torch.Tensor | None = None, block_n: int | None = None, block_m: int | None = None,
                  block_k: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> torch.Tensor:
    """x [M, K] ([M, 2K] when gated) @ dequant(w).T + bias (+ residual) -> [M, N] in x's dtype, for a weight
    `takes_tensor_cores` accepts, x in row blocks of `block_m` (16, 32, ... 256). Arguments are checked by
    `quant_matmul`, the entry point."""
    num_rows = x.shape[0]
    n, k = w.shape
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    tiles = quant_gemv_tc_config(n, k, w.group_size, x.device, gated or norm_weight is not None, w.tile_n > 0,
                                 num_rows)
    block_n, block_m = block_n or tiles["block_n"], block_m or tiles["block_m"]
    block_k = min(block_k or tiles["block_k"], tiles["block_k"])
    sub_k = min(block_k, tiles["sub_k"])
    split = split_k or tiles["split_k"]
    num_row_blocks = triton.cdiv(num_rows, block_m)
    ws, counts = (workspace(x.device, split * num_row_blocks * block_m * n, num_row_blocks * triton.cdiv(n, block_n))
                  if split > 1 else (x, x))
    opts = {} if is_interpreter() else {"num_warps": num_warps or tiles["num_warps"],
                                        "num_stages": num_stages or tiles["num_stages"]}
    _quant_gemv_tc_kernel[(triton.cdiv(n, block_n), split, num_row_blocks)](
        x, w.perm if w.perm is not None else x, bias if bias is not None else x,
        norm_weight if norm_weight is not None else x, residual if residual is not None else x, out, ws, counts,
        w.qs, w.scales, w.zeros if w.zeros is not None else w.scales, w.qs.stride(0), w.scales.stride(0),
        num_rows, n, k, eps, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        GROUP=w.group_size, ZERO=float(w.zero), HAS_ZEROS=w.zeros is not None, HAS_PERM=w.perm is not None,
        HAS_BIAS=bias is not None, GATED=gated, NORM=norm_weight is not None, RESIDUAL=residual is not None,
        BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, SUB_K=sub_k, SPLIT_K=split,
        SCALED=block_m > SCALED_PAST_ROWS, TILE_N=w.tile_n, **opts,
        # NOTE: row blocks launch without programmatic dependent launch, as the GEMM does (`kernels.quant_gemm`):
        # the next launch's waiting programs hold the multiprocessors these large grids need
        **(pdl_args(x.device) if block_m == MAX_ROWS else {"USE_PDL": False}))
    return out
