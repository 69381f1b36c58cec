"""Dynamic e4m3 quantization of activations for the fp8 GEMMs, in one launch.

    x [M, K] -> (e4m3 [M, K], float32 scales [M, cdiv(K, group)])
    grid (M, cdiv(num_groups, GROUPS)): a program takes GROUPS groups of one row, each group's largest
    magnitude maps to FP8_MAX (scale = amax / FP8_MAX, at least MIN_SCALE), its values divided by the scale
    rounded to e4m3.

`quantize_fp8_silu_and_mul` quantizes the gated MLP's silu(gate) * up the same way in the launch that computes
it (the down projection's input), bit for bit `quantize_fp8_rows(silu_and_mul(x))` without the 16-bit copy.

Bit for bit `fp8_gemm.quantize_fp8_groups` (torch's ops, kept as the reference and for weights at load):
IEEE division (`div_rn`: Triton's `/` is approximate), round to nearest even. Torch spends eight kernels
on it (cast, pad, abs, amax, divide, clamp, divide, clamp + cast): ~25 us a projection at 256 rows, more
than the fp8 GEMM saves over bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import _INTERPRETED, FP8_DTYPE, FP8_MAX, cast, is_interpreter, next_pow2, require

MIN_SCALE = 1e-12  # an all-zero group still gets a finite scale
MAX_BLOCK = 1024  # columns a program takes when groups are narrower (pow2 groups: block-wise scales)


@triton.jit
def _to_e4m3(v, DTYPE: tl.constexpr):
    """fp32 v (|v| <= FP8_MAX) to e4m3, rounding to nearest even.

    NOTE: the interpreter's conversion drops the carry of a rounding that crosses a power of two
    (124.3 -> 64): there the value is rounded in fp32 first (3 mantissa bits; e4m3's subnormals are
    multiples of 2**-9) and the exact e4m3 value converted."""
    if _INTERPRETED:
        bits = v.to(tl.int32, bitcast=True)
        normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576: 0xFFF00000
        y = v * 512.0
        floor = tl.floor(y)
        frac = y - floor
        odd = (floor - 2.0 * tl.floor(floor * 0.5)) == 1.0
        subnormal = tl.where((frac > 0.5) | ((frac == 0.5) & odd), floor + 1.0, floor) / 512.0
        v = tl.where(tl.abs(v) >= 0.015625, normal.to(tl.float32, bitcast=True), subnormal)  # 2**-6
    return v.to(DTYPE)


@triton.jit
def store_fp8_groups(x, q_row_ptr, s_row_ptr, groups, cols, mask, num_groups, MIN_SCALE_: tl.constexpr,
                     FP8_MAX_: tl.constexpr):
    """x [G, BG] fp32 (zero where masked) -> its e4m3 codes at q_row_ptr + cols, one scale a group at s_row_ptr."""
    amax = tl.max(tl.abs(x), 1)  # [G]
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX_, tl.float32)), MIN_SCALE_)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -FP8_MAX_), FP8_MAX_)
    tl.store(q_row_ptr + cols, _to_e4m3(q, q_row_ptr.dtype.element_ty), mask=mask)
    tl.store(s_row_ptr + groups, scale, mask=groups < num_groups)


@triton.jit
def _quantize_fp8_kernel(
    x_ptr,  # [M, K] fp32 / fp16 / bf16; GATED: [M, 2K], gate then up
    q_ptr,  # [M, K] e4m3
    s_ptr,  # [M, num_groups] float32
    K, num_groups, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    MIN_SCALE_: tl.constexpr, FP8_MAX_: tl.constexpr, GATED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [G]
    offs = tl.arange(0, BLOCK_G)  # [BG]
    cols = groups[:, None] * GROUP + offs[None, :]  # [G, BG]
    mask = (groups[:, None] < num_groups) & (offs[None, :] < GROUP) & (cols < K)
    if GATED:
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + K + cols, mask=mask, other=0.0).to(tl.float32)
        # Rounded to x's dtype first, as `silu_and_mul` stores it: the unfused path's values exactly.
        x = cast(gate * tl.sigmoid(gate) * up, x_ptr.dtype.element_ty).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    store_fp8_groups(x, q_ptr + row * stride_q, s_ptr + row * stride_s, groups, cols, mask, num_groups, MIN_SCALE_,
                     FP8_MAX_)


def quantize_fp8_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (inner-contiguous) -> (e4m3 [M, K], float32 scales [M, cdiv(K, group)]), as
    `quantize_fp8_groups` computes them."""
    return _launch(x, x.shape[1], group, gated=False)


def quantize_fp8_silu_and_mul(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2K] (gate then up, inner-contiguous) -> `quantize_fp8_rows(silu_and_mul(x), group)`, bit for bit,
    in one launch."""
    require(x.dim() == 2 and x.shape[1] % 2 == 0, lambda: f"x: expected [M, 2K], got {tuple(x.shape)}")
    require(x.stride(-1) == 1, "x: expected contiguous rows")
    return _launch(x, x.shape[1] // 2, group, gated=True)


def _launch(x: torch.Tensor, k: int, group: int, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, k], scales [M, cdiv(k, group)]) of x's M rows (gated: of silu(gate) * up)."""
    m = x.shape[0]
    num_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    block_g = next_pow2(min(group, k))
    groups = max(1, MAX_BLOCK // block_g) if group & (group - 1) == 0 else 1  # several whole pow2 groups
    groups = min(groups, next_pow2(num_groups))
    opts = {} if is_interpreter() else {"num_warps": min(16, max(4, groups * block_g // 1024))}
    _quantize_fp8_kernel[(m, triton.cdiv(num_groups, groups))](
        x, q, scale, k, num_groups, x.stride(0), q.stride(0), scale.stride(0), GROUP=group, GROUPS=groups,
        BLOCK_G=block_g, MIN_SCALE_=MIN_SCALE, FP8_MAX_=FP8_MAX, GATED=gated, **opts)
    return q, scale
