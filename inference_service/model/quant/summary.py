"""What a packed weight is, for GetModelInfo, /v1/models and the startup log."""

from __future__ import annotations

from kernels.fp8_gemm import Fp8Weight
from kernels.quant_layout import IntPackedWeight

PackedWeight = IntPackedWeight | Fp8Weight


def describe_weight(weight: PackedWeight) -> dict:
    """{"format", "bits", "group_size", "num_bytes"} of one packed weight."""
    if isinstance(weight, Fp8Weight):
        n, k = weight.shape
        block = "tensor" if (weight.block_n, weight.block_k) == (n, k) else (
            "channel" if (weight.block_n, weight.block_k) == (1, k) else f"block {weight.block_n}x{weight.block_k}")
        return {"format": f"fp8 e4m3 ({block})", "bits": 8, "group_size": weight.block_k, "num_bytes": weight.nbytes}
    return {"format": f"int{weight.bits}", "bits": weight.bits, "group_size": weight.group_size,
            "num_bytes": weight.nbytes}
