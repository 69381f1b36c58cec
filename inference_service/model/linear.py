"""`Linear`: y = x W^T + b with Hugging Face's [out, in] weight, packed for oneDNN on CPU, or kept in
GGUF blocks.

Decode on CPU is bound by how fast the weights stream through the matmul. MKL's sgemm on the
row-major [out, in] weight reaches about half the machine's read bandwidth at batch 1; oneDNN with the
weight re-laid out once ("packed") for its blocked kernels reaches nearly all of it, and is also faster
at batch 4-16. So after loading, CPU weights are packed and the plain copy is released.

Quantized rows (`load_quantized_rows`, from a GGUF's Q4_0 / Q4_1 / Q8_0 tensors) are read in their
blocks by the C++ kernels instead, a fifth to a quarter of the bytes of float32; a step of many rows
(prefill) expands them and runs one BLAS matmul, which costs less than dequantizing per row there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.cpu_kernels.quant import QuantizedWeight, dequantize_rows, quant_matmul

# Packing is tuned for a batch of this many rows; other batch sizes still run, a little slower.
_PACK_BATCH_HINT = 16
# Above this many input rows a quantized layer expands its weight and runs one dense matmul: about where
# the two cost the same for the embedded model on a 2-core CPU (bench/results/cpu-2026-11-25/README.md).
MAX_QUANTIZED_MATMUL_ROWS = 48


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
        # Quantized row ranges as (first row, weight), sorted; set by `load_quantized_rows`.
        self.quantized: list[tuple[int, QuantizedWeight]] = []

    def load_quantized_rows(self, first_row: int, weight: QuantizedWeight) -> None:
        """Rows [first_row, first_row + rows) of the weight, kept in their blocks."""
        if weight.shape[1] != self.in_features or not 0 <= first_row <= self.out_features - weight.shape[0]:
            raise ValueError(f"quantized rows {weight.shape} at {first_row} do not fit [{self.out_features}, "
                             f"{self.in_features}]")
        self.quantized = sorted([*self.quantized, (first_row, weight)], key=lambda part: part[0])

    @property
    def num_packed_bytes(self) -> int:
        """Bytes of the weight held outside its parameters: oneDNN-packed or in quantized blocks."""
        packed = 0 if self._packed is None else self._packed.numel() * self._packed.element_size()
        return packed + sum(weight.nbytes for _, weight in self.quantized)

    def pack(self, release_weight: bool = True) -> None:
        """Re-lay the weight out for oneDNN, or finish a quantized one (CPU only; elsewhere a no-op).
        With `release_weight`, the plain weight's storage is freed: the layer can no longer be re-loaded."""
        if self.quantized:
            self._finish_quantized(release_weight)
            return
        if self._packed is not None or not can_pack(self.weight):
            return
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_BATCH_HINT)
        if release_weight:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def _finish_quantized(self, release_weight: bool) -> None:
        num_quantized = sum(weight.shape[0] for _, weight in self.quantized)
        if num_quantized != self.out_features:
            # Part of the rows came dense (a type the kernels do not run): expand the rest beside them.
            with torch.no_grad():
                for first, weight in self.quantized:
                    self.weight[first:first + weight.shape[0]].copy_(dequantize_rows(weight))
            self.quantized = []
            self.pack(release_weight)
            return
        # Stack neighbouring parts of one type (q, k, v -> qkv) so a step makes one call for them.
        merged = [self.quantized[0]]
        for first, weight in self.quantized[1:]:
            if weight.qtype is merged[-1][1].qtype:
                merged[-1] = (merged[-1][0], QuantizedWeight.concat([merged[-1][1], weight]))
            else:
                merged.append((first, weight))
        self.quantized = merged
        if release_weight:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out]."""
        if self.quantized:
            return self._quantized_forward(x)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _quantized_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.shape[0] > MAX_QUANTIZED_MATMUL_ROWS:
            parts = [dequantize_rows(part) for _, part in self.quantized]
            weight = parts[0] if len(parts) == 1 else torch.cat(parts)  # [out, in]
            return F.linear(x, weight, self.bias)
        if len(self.quantized) == 1:  # the usual case, kept short: a decode step makes ~150 of these calls
            out = quant_matmul(x, self.quantized[0][1])  # [N, out]
        else:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)  # [N, out]
            for first, weight in self.quantized:
                quant_matmul(x, weight, out[:, first:first + weight.shape[0]])
        if self.bias is not None:
            out += self.bias
        return out
