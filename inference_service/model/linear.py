"""`Linear`: y = x W^T + b with Hugging Face's [out, in] weight, packed for oneDNN on CPU.

Decode on CPU is bound by how fast the weights stream through the matmul. MKL's sgemm on the
row-major [out, in] weight reaches about half the machine's read bandwidth at batch 1; oneDNN with the
weight re-laid out once ("packed") for its blocked kernels reaches nearly all of it, and is also faster
at batch 4-16. So after loading, CPU weights are packed and the plain copy is released.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Packing is tuned for a batch of this many rows; other batch sizes still run, a little slower.
_PACK_BATCH_HINT = 16


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            # NOTE: oneDNN's bf16 reorder needs AVX512-BF16/AVX-NE-CONVERT-class CPUs; elsewhere bf16 stays plain.
            and (weight.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Linear(nn.Module):
    """A bias-optional linear layer whose `weight` [out, in] is loaded by name, then `pack()`ed."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self._packed: torch.Tensor | None = None  # oneDNN blocked copy of `weight`

    def pack(self, release_weight: bool = True) -> None:
        """Re-lay the weight out for oneDNN (CPU only; elsewhere a no-op). With `release_weight`, the
        plain weight's storage is freed: the layer can no longer be re-loaded."""
        if self._packed is not None or not can_pack(self.weight):
            return
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_BATCH_HINT)
        if release_weight:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]."""
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
