"""Rotary position embedding, applied in place to q and k, and the cos/sin cache it reads.

The cache row for position p is `[cos(p * f_0..f_{r/2-1}) | sin(...)]` (r = rotary_dim <= head_dim),
scaled by the rope kind's attention factor. Pairs rotated, with x' = x1 * cos - x2 * sin and
y' = x2 * cos + x1 * sin::

    neox:  (x[i], x[i + r/2])     first half against second half
    gpt-j: (x[2i], x[2i + 1])     interleaved

Dimensions past rotary_dim are left as they are. The tables themselves (every rope type's
frequencies) are built by `inference_service.model.rope` (`build_cos_sin_cache`, `kernel_cos_sin_cache`):
this file only applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    cast,
    is_interpreter,
    next_pow2,
    pdl_args,
    pdl_enter,
    require,
    require_dtype,
    require_inner_contiguous,
    require_same_device,
)


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_tok,
    stride_head,
    cos,
    sin,
    norm_ptr,  # [2 * HALF] per-head RMSNorm weight (HAS_NORM)
    eps,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    if IS_NEOX:
        i1 = offs_i
        i2 = offs_i + HALF
    else:
        i1 = 2 * offs_i
        i2 = 2 * offs_i + 1
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_i < HALF)[None, :]
    row = x_ptr + token * stride_tok + offs_h[:, None] * stride_head
    x1 = tl.load(row + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # QK-norm (Qwen3): each head's RMSNorm over its whole row (= the rotary pairs), rounded to the
        # activation dtype as the norm kernel would store it, then rotated
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)  # [BLOCK_H]
        w1 = tl.load(norm_ptr + i1, mask=offs_i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + i2, mask=offs_i < HALF, other=0.0).to(tl.float32)
        x1 = cast(x1 * inv_rms[:, None] * w1[None, :], x_ptr.dtype.element_ty).to(tl.float32)
        x2 = cast(x2 * inv_rms[:, None] * w2[None, :], x_ptr.dtype.element_ty).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(row + i1[None, :], cast(y1, x_ptr.dtype.element_ty), mask=mask)
    tl.store(row + i2[None, :], cast(y2, x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens]
    cos_sin_ptr,  # [max_position, rotary_dim]
    q_norm_ptr,  # [head_dim] (HAS_NORM)
    k_norm_ptr,
    eps,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_K: tl.constexpr,
    HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_mask = offs_i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_i, mask=i_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_i, mask=i_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, stride_q_tok, stride_q_head, cos, sin, q_norm_ptr, eps, NUM_Q_HEADS, HALF, BLOCK_HQ,
                  BLOCK_HALF, IS_NEOX, HAS_NORM)
    if HAS_K:
        _rotate_heads(k_ptr, token, stride_k_tok, stride_k_head, cos, sin, k_norm_ptr, eps, NUM_KV_HEADS, HALF,
                      BLOCK_HK, BLOCK_HALF, IS_NEOX, HAS_NORM)


def apply_rotary(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], rotated in place
    k: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    positions: torch.Tensor,  # [num_tokens] int64 or int32
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim]
    *,
    is_neox: bool = True,
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]: each head RMSNorm-ed first (QK-norm)
    k_norm_weight: torch.Tensor | None = None,  # [head_dim]
    norm_eps: float = 1e-6,
) -> None:
    """Rotate the first `rotary_dim` dims of every head of q (and k) by its token's position.

    With `q_norm_weight` / `k_norm_weight` (both, and a rotary over the whole head), each head of q and k is
    first RMS-normalized with its weight (Qwen3's QK-norm; one launch instead of a norm a tensor and the
    copies out of the fused projection a strided row needed). Positions must lie in [0, max_position). q and k
    may be strided views (e.g. of a fused qkv output); the last dim must be contiguous."""
    require(q.dim() == 3, lambda: f"q: expected [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    require(cos_sin_cache.dim() == 2, lambda: f"cos_sin_cache: expected [max_position, rotary_dim], got {tuple(cos_sin_cache.shape)}")
    rotary_dim = cos_sin_cache.shape[1]
    require(rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, lambda: f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
    require_dtype("q", q, ACT_DTYPES)
    require_dtype("cos_sin_cache", cos_sin_cache, ACT_DTYPES)
    require(cos_sin_cache.stride(1) == 1, "cos_sin_cache rows must be contiguous")
    require(positions.shape == (num_tokens,), lambda: f"positions: shape {tuple(positions.shape)} != ({num_tokens},)")
    require_dtype("positions", positions, (torch.int64, torch.int32))
    require(positions.is_contiguous(), "positions must be contiguous")
    require_inner_contiguous("q", q)
    num_kv_heads = 1
    if k is not None:
        require(k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, lambda: f"k: shape {tuple(k.shape)}")
        require(k.dtype == q.dtype, "q and k dtypes differ")
        require_inner_contiguous("k", k)
        num_kv_heads = k.shape[1]
        require_same_device(q=q, k=k, positions=positions, cos_sin_cache=cos_sin_cache)
    else:
        require_same_device(q=q, positions=positions, cos_sin_cache=cos_sin_cache)
    has_norm = q_norm_weight is not None
    if has_norm or k_norm_weight is not None:
        require(has_norm and k is not None and k_norm_weight is not None, "QK-norm needs q, k and both weights")
        require(rotary_dim == head_dim, lambda: f"QK-norm with the rotary needs rotary_dim == head_dim ({rotary_dim} != {head_dim})")
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            require(w.shape == (head_dim,) and w.is_contiguous(), lambda name=name, w=w: f"{name}: shape {tuple(w.shape)}")
            require_dtype(name, w, ACT_DTYPES)
        require(norm_eps > 0, "norm_eps must be positive")
    if num_tokens == 0:
        return
    half = rotary_dim // 2
    opts = {} if is_interpreter() else {"num_warps": 4}
    _rotary_kernel[(num_tokens,)](
        q,
        k if k is not None else q,
        positions,
        cos_sin_cache,
        q_norm_weight if has_norm else cos_sin_cache,
        k_norm_weight if has_norm else cos_sin_cache,
        float(norm_eps),
        q.stride(0),
        q.stride(1),
        k.stride(0) if k is not None else 0,
        k.stride(1) if k is not None else 0,
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_HQ=next_pow2(num_q_heads),
        BLOCK_HK=next_pow2(num_kv_heads),
        BLOCK_HALF=next_pow2(half),
        IS_NEOX=is_neox,
        HAS_K=k is not None,
        HAS_NORM=has_norm,
        **opts,
        **pdl_args(q.device),
    )


@dataclass(frozen=True)
class Rotary:
    """A step's rotary of q and k (neox pairs), optionally after each head's RMSNorm (Qwen3's QK-norm), for
    whoever applies it: `apply`, or the decode attention kernel itself (`kernels/decode_prologue.py`)."""

    positions: torch.Tensor  # [num_tokens] int64 or int32
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim]
    q_norm_weight: torch.Tensor | None = None  # [head_dim]
    k_norm_weight: torch.Tensor | None = None  # [head_dim]
    norm_eps: float = 1e-6

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (`apply_rotary`)."""
        apply_rotary(q, k, self.positions, self.cos_sin_cache, is_neox=True, q_norm_weight=self.q_norm_weight,
                     k_norm_weight=self.k_norm_weight, norm_eps=self.norm_eps)


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, is_neox: bool = True) -> torch.Tensor:
    """float64 rotated copy of x [num_tokens, num_heads, head_dim]."""
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    cs = cos_sin_cache[positions.long()].to(torch.float64)
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    out = x.to(torch.float64).clone()
    rot = out[..., :rotary_dim]
    if is_neox:
        x1, x2 = rot[..., :half].clone(), rot[..., half:].clone()
        rot[..., :half] = x1 * cos - x2 * sin
        rot[..., half:] = x2 * cos + x1 * sin
    else:
        x1, x2 = rot[..., 0::2].clone(), rot[..., 1::2].clone()
        rot[..., 0::2] = x1 * cos - x2 * sin
        rot[..., 1::2] = x2 * cos + x1 * sin
    return out
