"""In-situ quantization of a 16-bit checkpoint at load (`--quantization fp8|int8|int4`).

int4: symmetric, group 128, codes q + 8 with one fp16 scale per group (amax / 7). int8: symmetric,
per output channel (amax / 127). fp8: e4m3 per output channel (amax / 448), dynamic activations.
Round to nearest; no calibration data (GPTQ/AWQ checkpoints are the calibrated route).
"""

from __future__ import annotations

import torch

from kernels.fp8_gemm import Fp8Weight, quantize_fp8_groups
from kernels.quant_layout import IntPackedWeight, pack_int

IN_SITU_METHODS = ("fp8", "int8", "int4")
INT4_GROUP = 128
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
    bits, group = (4, INT4_GROUP) if method == "int4" else (8, k)
    if k % group:
        raise ValueError(f"{method}: K={k} is not a multiple of the group size {group}")
    qmax = (1 << (bits - 1)) - 1
    groups = w.view(n, k // group, group)
    scale = (groups.abs().amax(-1) / qmax).clamp(min=_MIN_SCALE).to(torch.float16)
    codes = torch.round(groups / scale.float()[:, :, None]).clamp(-qmax - 1, qmax) + (qmax + 1)
    return pack_int(codes.view(n, k), bits, group, scale, zero=qmax + 1)
