"""RMSNorm, optionally fused with the residual add that precedes it.

    residual <- x + residual                  (rounded to residual's dtype, in place)
    out      <- residual / rms(residual) * (weight + weight_offset)

`weight_offset=1.0` gives Gemma's `(1 + w)` form. One program normalises one row in fp32.

`rms_norm_fp8` quantizes `out` to e4m3 for an fp8 projection in the same launch (one scale a row, bit for bit
`fp8_quant.quantize_fp8_rows` of the 16-bit `out`, which is never written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    FP8_DTYPE,
    FP8_MAX,
    cast,
    is_interpreter,
    next_pow2,
    num_sms,
    pdl_enter,
    pdl_launch_args,
    require,
    require_dtype,
    require_inner_contiguous,
    require_same_device,
    require_shape,
)
from kernels.fp8_quant import MIN_SCALE, store_fp8_groups

_MIN_SCALE: tl.constexpr = tl.constexpr(MIN_SCALE)
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_MAX)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    eps,
    weight_offset,
    stride_x,
    stride_r,
    stride_o,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    scale_ptr=None,  # [num_tokens, 1] float32 (QUANTIZE)
    QUANTIZE: tl.constexpr = False,  # out is e4m3, one scale a row
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r + offs
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        h = cast(x.to(tl.float32) + r.to(tl.float32), r.dtype)
        tl.store(r_ptrs, h, mask=mask)
        h = h.to(tl.float32)
    else:
        h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32) + weight_offset
    if QUANTIZE:
        # The values the 16-bit norm would store, then quantized as the activation quantizer does (one group).
        y = cast(h * inv_rms * w, x_ptr.dtype.element_ty).to(tl.float32)
        store_fp8_groups(tl.reshape(y, (1, BLOCK)), out_ptr + row * stride_o, scale_ptr + row, tl.arange(0, 1),
                         tl.reshape(offs, (1, BLOCK)), tl.reshape(mask, (1, BLOCK)), 1, _MIN_SCALE, _FP8_MAX)
    else:
        tl.store(out_ptr + row * stride_o + offs, cast(h * inv_rms * w, out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out, weight_offset, scale=None):
    require(x.dim() == 2, lambda: f"x: expected [num_tokens, hidden], got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    require_dtype("x", x, ACT_DTYPES)
    require_shape("weight", weight, (hidden,))
    require_dtype("weight", weight, ACT_DTYPES)
    require(weight.is_contiguous(), "weight must be contiguous")
    require_inner_contiguous("x", x)
    if residual is not None:
        require_shape("residual", residual, tuple(x.shape))
        require_dtype("residual", residual, ACT_DTYPES)
        require_inner_contiguous("residual", residual)
    require_shape("out", out, tuple(x.shape))
    require_dtype("out", out, (FP8_DTYPE,) if scale is not None else ACT_DTYPES)
    require_inner_contiguous("out", out)
    require(eps > 0, "eps must be positive")
    require_same_device(x=x, weight=weight, out=out, **({"residual": residual} if residual is not None else {}))
    if num_tokens == 0:
        return out
    block = next_pow2(hidden)
    # NOTE: a grid smaller than the machine (a decode step of few rows) runs each row's program alone on a
    # multiprocessor and the next launch waits for it: its latency is the kernel's time, and more warps (8 values
    # a thread) shorten it. One H200, batch-1 decode, 4096 wide: 16 warps against 4, int4 392.7 -> 400.4 tok/s,
    # fp8 306.8 -> 311.4 (bench/results/h200-2026-11-29)
    per_warp = 256 if num_tokens < num_sms(x.device) else 1024
    opts = {} if is_interpreter() else {"num_warps": min(16, max(4, block // per_warp))}
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        float(eps),
        float(weight_offset),
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        **({"scale_ptr": scale, "QUANTIZE": True} if scale is not None else {}),
        **opts,
        **pdl_launch_args(x.device, num_tokens),
    )
    return out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, hidden]; may be x
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """x / rms(x) * (weight + weight_offset), computed in fp32."""
    return _launch(x, None, weight, eps, torch.empty_like(x) if out is None else out, weight_offset)


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden], updated in place to x + residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, hidden]; default x (in place)
    weight_offset: float = 0.0,
) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual) written to `out` (default: into x)."""
    return _launch(x, residual, weight, eps, x if out is None else out, weight_offset)


def rms_norm_fp8(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden], updated in place to x + residual
    weight: torch.Tensor,  # [hidden]
    eps: float,
    *,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [num_tokens, hidden], float32 scales [num_tokens, 1]): `rms_norm` (or, with a residual,
    `fused_add_rms_norm`) then `quantize_fp8_rows(.., hidden)`, bit for bit, in one launch: the input of an fp8
    projection with one scale a row of its input (per-tensor and per-channel weights).

    NOTE: one scale a row only: in 128-column groups (block-wise weights) the norm's one program a row
    quantizing 32 groups took 659 us at 8k x 4096 rows against 149 for the norm and the quantizer apart (H100)."""
    require(x.dim() == 2, lambda: f"x: expected [num_tokens, hidden], got {tuple(x.shape)}")
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _launch(x, residual, weight, eps, q, weight_offset, scale)
    return q, scale


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    weight_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed in float64, new residual in residual's dtype or None); inputs untouched."""
    h = x
    new_residual = None
    if residual is not None:
        new_residual = (x.to(torch.float32) + residual.to(torch.float32)).to(residual.dtype)
        h = new_residual
    h = h.to(torch.float64)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (weight.to(torch.float64) + weight_offset)
    return normed, new_residual
