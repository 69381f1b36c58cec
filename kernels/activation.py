"""SiLU-and-mul: out = silu(x[:, :d]) * x[:, d:] for the gated MLP's fused gate/up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    cast,
    is_interpreter,
    next_pow2,
    pdl_enter,
    pdl_launch_args,
    require,
    require_dtype,
    require_inner_contiguous,
    require_same_device,
    require_shape,
)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * d]
    out_ptr,  # [num_tokens, d]
    stride_x,
    stride_o,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + offs, cast(y, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate then up
    *,
    out: torch.Tensor | None = None,  # [num_tokens, d]
) -> torch.Tensor:
    """silu(gate) * up, computed in fp32, rounded once to out's dtype."""
    require(x.dim() == 2 and x.shape[1] % 2 == 0, lambda: f"x: expected [num_tokens, 2 * d], got {tuple(x.shape)}")
    num_tokens, two_d = x.shape
    d = two_d // 2
    require_dtype("x", x, ACT_DTYPES)
    require_inner_contiguous("x", x)
    if out is None:
        out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    require_shape("out", out, (num_tokens, d))
    require_dtype("out", out, ACT_DTYPES)
    require_inner_contiguous("out", out)
    require_same_device(x=x, out=out)
    if num_tokens == 0 or d == 0:
        return out
    block = min(next_pow2(d), 1024)
    opts = {} if is_interpreter() else {"num_warps": 4}
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), D=d, BLOCK=block,
                                                               **opts, **pdl_launch_args(x.device, num_tokens))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """float64 silu(gate) * up."""
    gate, up = x.to(torch.float64).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
