"""A packed integer weight widened into a dense fp16 / bf16 matrix on the GPU, for large row counts.

Past a few hundred rows a matmul is bound by its multiply-adds, and the library's 16-bit GEMM (cuBLAS)
runs them faster than a Triton kernel that widens each weight tile in its own loop can (the widening does
not overlap the tensor cores there). Widening the whole weight once (reading its packed bytes, writing
16 bits a weight) and calling the library then costs one extra pass over a 16-bit weight, which a prefill
of a thousand tokens repays many times (vLLM's AWQ path does the same from 256 tokens on).

    grid (N / BLOCK_N, K / BLOCK_K): one program widens one [BLOCK_N, BLOCK_K] tile, the two nibble planes
    put back in column order; columns stay in packed order (act-order weights: gather x by `perm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreter
from kernels.quant_layout import (
    IntPackedWeight,
    act_planes,
    kernel_args,
    planes_in_k_order,
    takes_half_planes,
    tile_for,
)


@triton.jit
def _widen_kernel(
    out_ptr,  # [N, K] fp16 / bf16 / fp32, packed column order
    qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, stride_qs, stride_qh, stride_s,  # the packed weight
    N, K, stride_out,
    BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_OFFSETS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
    GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr, HALF: tl.constexpr,
    TILE_N: tl.constexpr = 0,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w_lo, w_hi, _, _, _ = act_planes(
        qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s, BITS, GROUP, ZERO,
        HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP, HALF, out_ptr.dtype.element_ty,
        TILE_N=TILE_N)
    w = planes_in_k_order(w_lo, w_hi, BLOCK_N, BLOCK_K)
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (cols[None, :] < K)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_out + cols[None, :], w, mask=mask)


def widen(w: IntPackedWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight [N, K] in `dtype` (fp16 / bf16: 4-bit codes without offsets rounded as `half_planes`
    does, the rest widened in fp32 and rounded once), columns in packed order (x[:, w.perm] multiplies it)."""
    n, k = w.shape
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=w.qs.device)
    block_n = 64
    block_k, chunking = tile_for(w, 128)
    args, consts = kernel_args(w)
    opts = {} if is_interpreter() else {"num_warps": 4}
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _widen_kernel[grid](out, *args, n, k, out.stride(0), **consts, BLOCK_N=block_n, BLOCK_K=block_k, **chunking,
                        HALF=takes_half_planes(w, dtype, chunking), **opts)
    return out


def widened_matmul(x: torch.Tensor, w: IntPackedWeight, bias: torch.Tensor | None = None, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ widen(w).T + bias -> [M, N] through torch's matmul (cuBLAS on the GPU, fp32 accumulation).
    Arguments are checked by `quant_matmul`, the entry point."""
    if w.perm is not None:
        x = x.index_select(1, w.perm)
    weight = widen(w, x.dtype)
    y = torch.addmm(bias, x, weight.T) if bias is not None else x @ weight.T
    return y if out is None else out.copy_(y)
