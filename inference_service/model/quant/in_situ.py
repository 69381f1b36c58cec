"""In-situ quantization of a 16-bit checkpoint at load (`--quantization fp8|int8|int4|q4_k`).

int4: symmetric, group 128, codes q + 8 with one fp16 scale per group (amax / 7). int8: symmetric,
per output channel (amax / 127). fp8: e4m3 per output channel (amax / 448), dynamic activations.
q4_k: GGUF's Q4_K numbers (candle-vllm's `--isq q4k`): per 32 columns w = d * sc * q - dmin * m, codes q
0..15, the 6-bit sc and m under fp16 d and dmin per 256 columns, laid out as the loader repacks a GGUF's
Q4_K (fp32 products per group: 6 bits a weight; the min makes it asymmetric, which suits skewed groups
better than int4's). A projection whose K is not a multiple of 256 takes GGUF's Q4_1 instead (fp16 scale
and min per 32), as llama.cpp falls back for such rows.
Round to nearest; no calibration data (GPTQ/AWQ checkpoints are the calibrated route; llama.cpp's
quantizer also searches each group's scale and min, which this does not).
"""

from __future__ import annotations

import torch

from inference_service.config import IN_SITU_QUANTIZATIONS as IN_SITU_METHODS
from kernels.fp8_gemm import Fp8Weight, quantize_fp8_groups
from kernels.quant_layout import IntPackedWeight, pack_int

INT4_GROUP = 128
Q4_K_SUPER = 256  # columns of a Q4_K super-block (one d and dmin)
_MIN_SCALE = 2.0 ** -24  # smallest fp16 subnormal: all-zero groups stay zero


def quantize_in_situ(weight: torch.Tensor, method: str) -> IntPackedWeight | Fp8Weight:
    """weight [N, K] (any float dtype) -> its packed quantized form."""
    if method not in IN_SITU_METHODS:
        raise ValueError(f"quantization: expected one of {IN_SITU_METHODS}, got {method!r}")
    if weight.dim() != 2:
        raise ValueError(f"in-situ quantization takes 2-D weights, got {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.float()
    if method == "fp8":
        q, scale = quantize_fp8_groups(w, k)
        return Fp8Weight(q, scale, 1, k)
    if method == "q4_k":
        return quantize_q4_k(w)
    bits, group = (4, INT4_GROUP) if method == "int4" else (8, k)
    if k % group:
        raise ValueError(f"{method}: K={k} is not a multiple of the group size {group}")
    qmax = (1 << (bits - 1)) - 1
    groups = w.view(n, k // group, group)
    scale = (groups.abs().amax(-1) / qmax).clamp(min=_MIN_SCALE).to(torch.float16)
    codes = torch.round(groups / scale.float()[:, :, None]).clamp(-qmax - 1, qmax) + (qmax + 1)
    return pack_int(codes.view(n, k), bits, group, scale, zero=qmax + 1)


def quantize_q4_k(w: torch.Tensor) -> IntPackedWeight:
    """w [N, K] float32 -> Q4_K in the packed layout: per 32 columns the fp32 products d * sc and -(dmin * m), as
    the loader repacks a GGUF's Q4_K (Q4_1's fp16 scale and min where K is not a multiple of 256)."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"q4_k: K={k} is not a multiple of 32")
    if k % Q4_K_SUPER:  # Q4_1: w = d * q + m
        groups = w.view(n, k // 32, 32)
        low = groups.amin(-1)
        d = ((groups.amax(-1) - low) / 15).clamp(min=_MIN_SCALE).half()
        m = low.half()
        codes = torch.round((groups - m.float()[:, :, None]) / d.float()[:, :, None]).clamp(0, 15)
        return pack_int(codes.view(n, k), 4, 32, d, offsets=m)
    codes, d, sc, dmin, m = q4_k_parts(w)
    return pack_int(codes, 4, 32, _per_group(d) * sc, offsets=-(_per_group(dmin) * m))


def q4_k_parts(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w [N, K] float32 (K a multiple of 256) -> GGUF Q4_K's fields: (codes [N, K] 0..15, d [N, K/256] fp16,
    sc [N, K/32] 0..63, dmin [N, K/256] fp16, m [N, K/32] 0..63), sc and m as float32 integers; the weight is
    d * sc * q - dmin * m per 32 columns."""
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    low = groups.amin(-1).clamp(max=0.0)  # the min is 0 or below: GGUF subtracts dmin * m >= 0
    step = (groups.amax(-1) - low) / 15  # [N, K/32] each group's ideal scale
    per_super = (n, k // Q4_K_SUPER, Q4_K_SUPER // 32)
    d = (step.view(per_super).amax(-1) / 63).clamp(min=_MIN_SCALE).half()  # [N, K/256]
    dmin = ((-low).view(per_super).amax(-1) / 63).clamp(min=_MIN_SCALE).half()
    sc = torch.round(step.view(per_super) / d.float()[:, :, None]).clamp(0, 63).view(n, -1)
    m = torch.round((-low).view(per_super) / dmin.float()[:, :, None]).clamp(0, 63).view(n, -1)
    scale, offset = _per_group(d) * sc, -(_per_group(dmin) * m)  # what the kernels multiply by
    codes = torch.round((groups - offset[:, :, None]) / scale.clamp(min=_MIN_SCALE)[:, :, None]).clamp(0, 15)
    return codes.view(n, k), d, sc, dmin, m


def _per_group(t: torch.Tensor) -> torch.Tensor:
    """A super-block's fp16 value [N, K/256] as fp32 for each of its 8 groups [N, K/32]."""
    return t.float().repeat_interleave(Q4_K_SUPER // 32, 1)
