"""The one packed layout every weight-only integer format is repacked into at load (GPTQ, AWQ,
compressed-tensors w4a16, int8 per channel, in-situ int4/int8, GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K).

    w[n, k] = scales[n, g] * (q[n, k] - zero[n, g]) + offsets[n, g]      g = k // group_size

in fp32, in that order (GGUF's own order: the K-quants' `d * q - dmin * m` is `offsets = -dmin * m`),
so `dequantize_int` is bit-exact against the `gguf` package. q is an unsigned code of `bits` bits:

- `qs`: bits 8: [N, K] uint8, one code a byte. bits 4-6: [N, K / 2] uint8, the low 4 bits of two codes
  a byte; within each 32 columns byte j holds column j (low nibble) and column j + 16 (high nibble),
  GGUF Q4_0's order, so a kernel reads a tile's bytes contiguously and multiplies the two nibble planes
  by two strided views of x (no interleaving shuffle).
- `qh`: bits 5-6 only: [N, K * (bits - 4) / 8] uint8, the remaining high bits of column k at byte
  k // (8 / hb), bit (k % (8 / hb)) * hb, hb = bits - 4.
- `scales` [N, K / G] (fp16, bf16 or fp32: fp32 where the scale is a product, as the K-quants' d * sc,
  so it stays exact), `zeros` [N, K / G] uint8 or one constant `zero`, `offsets` [N, K / G] or none.
- `perm` [K] int32 or none: packed column k multiplies x[:, perm[k]] (GPTQ act-order: columns sorted by
  group at load so every group is contiguous, and the activations gathered instead).
- `tile_n`: 0, or `qs` in row tiles of that many rows (`kernels.quant_tiles`, what the GPU loader stores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import _INTERPRETED, cast
from kernels.quant_tiles import TILE_BYTES, TILE_ROWS, qs_offsets, row_major_qs

NIBBLE_SPAN = 32  # columns sharing one run of 16 bytes (byte j: columns j and j + 16)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class IntPackedWeight:
    """An [N, K] weight in the packed integer layout (module docstring)."""

    bits: int
    group_size: int
    qs: torch.Tensor
    scales: torch.Tensor
    qh: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    zero: int = 0
    offsets: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    tile_n: int = 0

    def __post_init__(self) -> None:
        n, num_groups = self.scales.shape
        k = num_groups * self.group_size
        if self.bits not in (4, 5, 6, 8):
            raise ValueError(f"bits: 4, 5, 6 or 8, got {self.bits}")
        if k % NIBBLE_SPAN or (self.group_size != 16 and self.group_size % NIBBLE_SPAN):
            raise ValueError(f"K={k} must be a multiple of {NIBBLE_SPAN} and group_size={self.group_size} 16 or "
                             f"a multiple of {NIBBLE_SPAN}")
        qs_shape = (n, k) if self.bits == 8 else (n, k // 2)
        _check("qs", self.qs, qs_shape, (torch.uint8,))
        if self.bits in (5, 6):
            _check("qh", self.qh, (n, k * (self.bits - 4) // 8), (torch.uint8,))
        elif self.qh is not None:
            raise ValueError(f"qh: only 5- and 6-bit codes have high bits, got one at bits={self.bits}")
        _check("scales", self.scales, (n, num_groups), SCALE_DTYPES)
        if self.zeros is not None:
            _check("zeros", self.zeros, (n, num_groups), (torch.uint8,))
        if self.offsets is not None:
            _check("offsets", self.offsets, (n, num_groups), SCALE_DTYPES)
        if self.perm is not None:
            _check("perm", self.perm, (k,), (torch.int32,))
        if not 0 <= self.zero < 1 << self.bits:
            raise ValueError(f"zero: {self.zero} outside the {self.bits}-bit codes")
        if self.tile_n and (self.bits != 4 or self.tile_n not in TILE_ROWS or n % self.tile_n
                            or k % (2 * TILE_BYTES)):
            raise ValueError(f"tile_n={self.tile_n}: tiles of {TILE_ROWS} rows x {2 * TILE_BYTES} columns take 4-bit "
                             f"codes with N and K their multiples, got bits={self.bits}, [{n}, {k}]")

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.group_size

    @property
    def nbytes(self) -> int:
        """Bytes a matmul reads (what the weight costs in GPU memory)."""
        parts = (self.qs, self.qh, self.scales, self.zeros, self.offsets, self.perm)
        return sum(t.nbytes for t in parts if t is not None)

    def to(self, device: torch.device | str) -> IntPackedWeight:
        moved = {name: (t.to(device) if isinstance(t, torch.Tensor) else t) for name, t in self.__dict__.items()}
        return IntPackedWeight(**moved)


def _check(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        got = None if t is None else (tuple(t.shape), t.dtype)
        raise ValueError(f"{name}: expected shape {tuple(shape)} of {dtypes}, got {got}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def pack_int(codes: torch.Tensor, bits: int, group_size: int, scales: torch.Tensor, *,
             zeros: torch.Tensor | None = None, zero: int = 0, offsets: torch.Tensor | None = None,
             perm: torch.Tensor | None = None) -> IntPackedWeight:
    """Pack unsigned codes [N, K] (any integer dtype, values < 2**bits) into the layout."""
    codes = codes.to(torch.int32)
    n, k = codes.shape
    if int(codes.min()) < 0 or int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes outside 0..{(1 << bits) - 1}")
    qh = None
    if bits == 8:
        qs = codes.to(torch.uint8)
    else:
        spans = (codes & 0x0F).view(n, k // NIBBLE_SPAN, 2, NIBBLE_SPAN // 2)  # [N, spans, lo|hi, 16]
        qs = (spans[:, :, 0] | (spans[:, :, 1] << 4)).reshape(n, k // 2).to(torch.uint8)
        if bits > 4:
            hb = bits - 4
            per = 8 // hb
            high = (codes >> 4).view(n, k // per, per)
            shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * hb
            qh = (high << shifts).sum(-1).to(torch.uint8)
    return IntPackedWeight(bits, group_size, qs.contiguous(), scales.contiguous(),
                           qh=None if qh is None else qh.contiguous(),
                           zeros=None if zeros is None else zeros.to(torch.uint8).contiguous(), zero=zero,
                           offsets=None if offsets is None else offsets.contiguous(),
                           perm=None if perm is None else perm.to(torch.int32).contiguous())


def unpack_codes(w: IntPackedWeight) -> torch.Tensor:
    """The codes q [N, K] int32 in packed column order (the inverse of `pack_int`)."""
    n, k = w.shape
    if w.bits == 8:
        return w.qs.to(torch.int32)
    qs = row_major_qs(w).to(torch.int32).view(n, k // NIBBLE_SPAN, 1, NIBBLE_SPAN // 2)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, k)
    if w.bits > 4:
        hb = w.bits - 4
        per = 8 // hb
        shifts = torch.arange(per, dtype=torch.int32, device=qs.device) * hb
        high = (w.qh.to(torch.int32)[:, :, None] >> shifts) & ((1 << hb) - 1)
        codes = codes | (high.reshape(n, k) << 4)
    return codes


def dequantize_int(w: IntPackedWeight, dtype: torch.dtype = torch.float32, *, unpermute: bool = True
                   ) -> torch.Tensor:
    """The weight [N, K] in `dtype` (float32: the formula's own rounding, bit-exact with GGUF's; float64:
    the exact values of the reference). `unpermute`: columns in the checkpoint's order, else packed."""
    codes = unpack_codes(w).to(dtype)

    def per_column(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).repeat_interleave(w.group_size, dim=1)

    zero = per_column(w.zeros) if w.zeros is not None else torch.tensor(float(w.zero), dtype=dtype)
    out = per_column(w.scales) * (codes - zero)
    if w.offsets is not None:
        out = out + per_column(w.offsets)
    if unpermute and w.perm is not None:
        out = torch.empty_like(out).index_copy_(1, w.perm.long(), out)
    return out


def quant_matmul_ref(x: torch.Tensor, w: IntPackedWeight, bias: torch.Tensor | None = None, gated: bool = False,
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """float64 x [M, K] @ dequant(w).T (+ bias, fused options as `kernels.gemv_ref`): the reference of
    every integer kernel."""
    from kernels.gemv import gemv_ref

    return gemv_ref(x, dequantize_int(w, torch.float64).to(x.device), bias, gated, norm_weight, eps, residual)


FLOAT_MAGIC = tl.constexpr(0x4B000000)  # the bits of 2.0 ** 23: OR-ing in an integer below 2**23 adds it
MAGIC_VALUE = tl.constexpr(8388608.0)  # 2.0 ** 23
UNIT_SCALE = tl.constexpr(16.0)  # a nibble in the top of the mantissa of 1.0 is the float 1 + q / UNIT_SCALE


@triton.jit
def tile_parts(qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s,
               BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
               HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
               GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr, UNIT_CODES: tl.constexpr = False,
               TILE_N: tl.constexpr = 0):
    """Columns k0 .. k0 + BLOCK_K of rows `offs_n` (k0 a multiple of BLOCK_K, itself of 32) as two planes,
    lo (columns j of each 32) and hi (j + 16), each cut into NC = BLOCK_K / 2 / CHUNK chunks of one group
    (`group_chunks`): (w_lo, s_lo, o_lo, w_hi, s_hi, o_hi, cols_lo, cols_hi, in_k, z_lo, z_hi) with w = q - zero
    exactly, fp32 [BN, NC, CHUNK], its group's scale and offset fp32 [BN, NC] (w * s + o is the weight), the
    planes' columns [BK/2], which are inside K, and each group's 2**23 + zero [BN, NC]. With UNIT_CODES, 4-bit
    codes come as w = 1 + q / 16 and z as 16 + zero (the GEMV's form: `quant_gemv`).

    NOTE: a code becomes a float without a conversion instruction (those run at a fraction of the FMA
    rate): the bits of (q | 0x4B000000) are the float 2**23 + q, and subtracting 2**23 + zero leaves
    q - zero exactly (integers below 2**24). Scales, zeros and offsets are loaded and widened once a
    group."""
    NUM_CHUNKS: tl.constexpr = BLOCK_K // 2 // CHUNK
    b = tl.arange(0, BLOCK_K // 2)
    cols_lo = k0 + (b // 16) * 32 + b % 16
    cols_hi = cols_lo + 16
    in_k = cols_lo < K  # K % 32 == 0: cols_hi < K alike
    n_mask = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    mask = n_mask[:, None] & in_k[None, :]
    if BITS == 8:
        q_lo = tl.load(qs_ptr + rows * stride_qs + cols_lo[None, :], mask=mask, other=0).to(tl.int32)
        q_hi = tl.load(qs_ptr + rows * stride_qs + cols_hi[None, :], mask=mask, other=0).to(tl.int32)
    else:
        byte = tl.load(qs_ptr + qs_offsets(rows, (k0 // 2 + b)[None, :], stride_qs, TILE_N), mask=mask,
                       other=0).to(tl.int32)
        q_lo = byte & 15
        q_hi = byte >> 4
        if BITS > 4:
            HB: tl.constexpr = BITS - 4
            PER: tl.constexpr = 8 // HB
            h_lo = tl.load(qh_ptr + rows * stride_qh + (cols_lo // PER)[None, :], mask=mask, other=0).to(tl.int32)
            h_hi = tl.load(qh_ptr + rows * stride_qh + (cols_hi // PER)[None, :], mask=mask, other=0).to(tl.int32)
            q_lo = q_lo | (((h_lo >> ((cols_lo % PER) * HB)[None, :]) & ((1 << HB) - 1)) << 4)
            q_hi = q_hi | (((h_hi >> ((cols_hi % PER) * HB)[None, :]) & ((1 << HB) - 1)) << 4)
    chunks = tl.arange(0, NUM_CHUNKS)
    group_lo = k0 // GROUP + chunks * GROUP_STEP  # [NC]
    in_groups = (k0 + chunks * (2 * CHUNK)) < K
    z_lo, s_lo, o_lo = _group_params(z_ptr, s_ptr, o_ptr, rows, group_lo, n_mask, in_groups, stride_s,
                                     ZERO, HAS_ZEROS, HAS_OFFSETS)
    if HI_GROUP == 0:
        z_hi = z_lo
        s_hi = s_lo
        o_hi = o_lo
    else:
        z_hi, s_hi, o_hi = _group_params(z_ptr, s_ptr, o_ptr, rows, group_lo + HI_GROUP, n_mask, in_groups,
                                         stride_s, ZERO, HAS_ZEROS, HAS_OFFSETS)
    if BITS == 4 and UNIT_CODES:
        # each nibble shifted into the top of the mantissa of 1.0: the float 1 + q / 16, and the zero's
        # term 16 + z = (2**23 + z) - (2**23 - 16), both exact (16: UNIT_SCALE)
        w_lo = tl.reshape((((byte << 19) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True),
                          (BLOCK_N, NUM_CHUNKS, CHUNK))
        w_hi = tl.reshape((((byte << 15) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True),
                          (BLOCK_N, NUM_CHUNKS, CHUNK))
        return w_lo, s_lo, o_lo, w_hi, s_hi, o_hi, cols_lo, cols_hi, in_k, z_lo - (MAGIC_VALUE - UNIT_SCALE), \
            z_hi - (MAGIC_VALUE - UNIT_SCALE)
    w_lo = tl.reshape((q_lo | FLOAT_MAGIC).to(tl.float32, bitcast=True), (BLOCK_N, NUM_CHUNKS, CHUNK))
    w_hi = tl.reshape((q_hi | FLOAT_MAGIC).to(tl.float32, bitcast=True), (BLOCK_N, NUM_CHUNKS, CHUNK))
    w_lo = w_lo - z_lo[:, :, None]
    w_hi = w_hi - z_hi[:, :, None]
    return w_lo, s_lo, o_lo, w_hi, s_hi, o_hi, cols_lo, cols_hi, in_k, z_lo, z_hi


@triton.jit
def _group_params(z_ptr, s_ptr, o_ptr, rows, groups, n_mask, in_groups, stride_s,
                  ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_OFFSETS: tl.constexpr):
    """For `groups` [NC] of `rows` [BN, 1]: (2**23 + zero, scale, offset), each fp32 [BN, NC]."""
    mask = n_mask[:, None] & in_groups[None, :]
    at = rows * stride_s + groups[None, :]
    scale = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + at, mask=mask, other=0).to(tl.float32) + MAGIC_VALUE
    else:
        zero = tl.zeros_like(scale) + (ZERO + MAGIC_VALUE)
    if HAS_OFFSETS:
        offset = tl.load(o_ptr + at, mask=mask, other=0.0).to(tl.float32)
    else:
        offset = scale  # unused
    return zero, scale, offset


@triton.jit
def dequant_tile(qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s,
                 BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
                 GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr, TILE_N: tl.constexpr = 0):
    """`tile_parts` widened to the weight: (w_lo, w_hi, cols_lo, cols_hi, in_k), planes fp32 [BN, BK/2]."""
    w_lo, s_lo, o_lo, w_hi, s_hi, o_hi, cols_lo, cols_hi, in_k, _, _ = tile_parts(
        qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s, BITS, GROUP, ZERO,
        HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP, TILE_N=TILE_N)
    w_lo = w_lo * s_lo[:, :, None]
    w_hi = w_hi * s_hi[:, :, None]
    if HAS_OFFSETS:
        w_lo += o_lo[:, :, None]
        w_hi += o_hi[:, :, None]
    return (tl.reshape(w_lo, (BLOCK_N, BLOCK_K // 2)), tl.reshape(w_hi, (BLOCK_N, BLOCK_K // 2)), cols_lo, cols_hi,
            in_k)


@triton.jit
def _magic_plus(code, ACT: tl.constexpr):
    """MAGIC + code exactly in ACT (bf16: MAGIC 128, fp16: 1024; code an int16 below 16): the code OR-ed
    into the mantissa of MAGIC, no conversion instruction."""
    if _INTERPRETED and ACT == tl.bfloat16:  # NOTE: the interpreter cannot bitcast 16 bits to bf16
        return ((code.to(tl.int32) | 0x4300) << 16).to(tl.float32, bitcast=True).to(ACT)
    else:
        return (code | (0x4300 if ACT == tl.bfloat16 else 0x6400)).to(ACT, bitcast=True)


@triton.jit
def half_planes(qs_ptr, s_ptr, z_ptr, offs_n, k0, N, K, stride_qs, stride_s, GROUP: tl.constexpr,
                ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                CHUNK: tl.constexpr, ACT: tl.constexpr, TILE_N: tl.constexpr = 0):
    """`dequant_tile` for 4-bit codes without offsets (groups of 32 or more) computed in ACT (fp16 / bf16):
    (MAGIC + q) - (MAGIC + zero) is q - zero exactly, times the scale (rounded to ACT) rounds once; the GPU
    works on two weights an instruction. Planes ACT [BN, BK/2]."""
    NUM_CHUNKS: tl.constexpr = BLOCK_K // 2 // CHUNK
    MAGIC: tl.constexpr = 128.0 if ACT == tl.bfloat16 else 1024.0
    b = tl.arange(0, BLOCK_K // 2)
    cols_lo = k0 + (b // 16) * 32 + b % 16
    in_k = cols_lo < K
    n_mask = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    byte = tl.load(qs_ptr + qs_offsets(rows, (k0 // 2 + b)[None, :], stride_qs, TILE_N),
                   mask=n_mask[:, None] & in_k[None, :], other=0).to(tl.int16)
    chunks = tl.arange(0, NUM_CHUNKS)
    mask = n_mask[:, None] & ((k0 + chunks * (2 * CHUNK)) < K)[None, :]
    at = rows * stride_s + (k0 // GROUP + chunks)[None, :]
    scale = cast(tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32), ACT)[:, :, None]  # [BN, NC, 1]
    if HAS_ZEROS:
        magic_zero = _magic_plus(tl.load(z_ptr + at, mask=mask, other=0).to(tl.int16), ACT)[:, :, None]
    else:
        magic_zero = tl.full((BLOCK_N, NUM_CHUNKS, 1), MAGIC + ZERO, ACT)
    magic_lo = tl.reshape(_magic_plus(byte & 15, ACT), (BLOCK_N, NUM_CHUNKS, CHUNK))
    magic_hi = tl.reshape(_magic_plus((byte >> 4) & 15, ACT), (BLOCK_N, NUM_CHUNKS, CHUNK))
    if _INTERPRETED and ACT == tl.bfloat16:  # the interpreter has no bf16 arithmetic: the same roundings in fp32
        w_lo = cast((magic_lo.to(tl.float32) - magic_zero.to(tl.float32)) * scale.to(tl.float32), ACT)
        w_hi = cast((magic_hi.to(tl.float32) - magic_zero.to(tl.float32)) * scale.to(tl.float32), ACT)
    else:
        w_lo = (magic_lo - magic_zero) * scale
        w_hi = (magic_hi - magic_zero) * scale
    return (tl.reshape(w_lo, (BLOCK_N, BLOCK_K // 2)), tl.reshape(w_hi, (BLOCK_N, BLOCK_K // 2)), cols_lo,
            cols_lo + 16, in_k)


@triton.jit
def act_planes(qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s,
               BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
               HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
               GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr, HALF: tl.constexpr, ACT: tl.constexpr,
               TILE_N: tl.constexpr = 0):
    """A tile's two planes in ACT, for the tensor cores: (w_lo, w_hi, cols_lo, cols_hi, in_k) as `dequant_tile`
    gives them. HALF (`takes_half_planes`): widened in ACT by `half_planes`; else in fp32, rounded once."""
    if HALF:
        return half_planes(qs_ptr, s_ptr, z_ptr, offs_n, k0, N, K, stride_qs, stride_s, GROUP, ZERO, HAS_ZEROS,
                           BLOCK_N, BLOCK_K, CHUNK, ACT, TILE_N=TILE_N)
    else:
        w_lo, w_hi, cols_lo, cols_hi, in_k = dequant_tile(
            qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s, BITS, GROUP,
            ZERO, HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP, TILE_N=TILE_N)
        return cast(w_lo, ACT), cast(w_hi, ACT), cols_lo, cols_hi, in_k


@triton.jit
def planes_in_k_order(w_lo, w_hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The two planes [BN, BK/2] of a tile as one [BN, BK] in column order."""
    # [BN, BK/32, 16, lo|hi] -> [BN, BK/32, lo|hi, 16]
    joined = tl.reshape(tl.join(w_lo, w_hi), (BLOCK_N, BLOCK_K // 32, 16, 2))
    return tl.reshape(tl.permute(joined, (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))


def takes_half_planes(w: IntPackedWeight, dtype: torch.dtype, chunking: dict) -> bool:
    """Whether `half_planes` widens w's tiles for `dtype` activations (4-bit codes without offsets, groups of 32
    or more, fp16 / bf16); `chunking` as `tile_for` gives it."""
    return (w.bits == 4 and w.offsets is None and dtype in (torch.float16, torch.bfloat16)
            and chunking["GROUP_STEP"] == 1 and chunking["HI_GROUP"] == 0)


def kernel_args(w: IntPackedWeight) -> tuple[list, dict]:
    """The pointer/stride arguments and constexprs `dequant_tile` takes, for a launcher."""
    dummy = w.scales
    ptrs = [w.qs, w.qh if w.qh is not None else dummy, w.scales, w.zeros if w.zeros is not None else dummy,
            w.offsets if w.offsets is not None else dummy]
    strides = [w.qs.stride(0), w.qh.stride(0) if w.qh is not None else 0, w.scales.stride(0)]
    consts = {"BITS": w.bits, "GROUP": w.group_size, "ZERO": float(w.zero), "HAS_ZEROS": w.zeros is not None,
              "HAS_OFFSETS": w.offsets is not None, "TILE_N": w.tile_n}
    return ptrs + strides, consts


def tile_for(w: IntPackedWeight, block_k: int) -> tuple[int, dict]:
    """The K tile for `w` (a power of two, a multiple of 32, no wider than K needs, never straddling two
    groups) and its chunking constexprs for `tile_parts`: (block_k, {CHUNK, GROUP_STEP, HI_GROUP}).

    One group a tile (per channel, or groups at least as wide as the tile); several groups of 32 or more
    (a group's lo and hi columns share it); groups of 16 (in each 32 columns, lo is one group, hi the next)."""
    group, k = w.group_size, w.shape[1]
    block_k = max(NIBBLE_SPAN, min(block_k, triton.next_power_of_2(k)))
    if group == 16:
        return block_k, {"CHUNK": 16, "GROUP_STEP": 2, "HI_GROUP": 1}
    if group < k and block_k % group == 0:
        return block_k, {"CHUNK": group // 2, "GROUP_STEP": 1, "HI_GROUP": 0}
    if group < k:  # a tile within one group: the largest power of two dividing it (a multiple of 32)
        block_k = min(block_k, group & -group)
    return block_k, {"CHUNK": block_k // 2, "GROUP_STEP": 1, "HI_GROUP": 0}
