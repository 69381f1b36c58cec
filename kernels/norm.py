"""RMSNorm, optionally fused with the residual add that precedes it.

    residual <- x + residual                  (rounded to residual's dtype, in place)
    out      <- residual / rms(residual) * (weight + weight_offset)

`weight_offset=1.0` gives Gemma's `(1 + w)` form. One program normalises one row in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    cast,
    is_interpreter,
    next_pow2,
    require,
    require_dtype,
    require_inner_contiguous,
    require_same_device,
    require_shape,
)


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
):
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
    tl.store(out_ptr + row * stride_o + offs, cast(h * inv_rms * w, out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out, weight_offset):
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
    require_dtype("out", out, ACT_DTYPES)
    require_inner_contiguous("out", out)
    require(eps > 0, "eps must be positive")
    require_same_device(x=x, weight=weight, out=out, **({"residual": residual} if residual is not None else {}))
    if num_tokens == 0:
        return out
    block = next_pow2(hidden)
    opts = {} if is_interpreter() else {"num_warps": min(16, max(4, block // 1024))}
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
        **opts,
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
