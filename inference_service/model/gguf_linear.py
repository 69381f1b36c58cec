"""`GGUFLinear`: a projection whose rows may come in GGUF blocks, run in place by the CPU kernels.

Rows given as a `QuantizedWeight` (a GGUF's Q4_0 / Q4_1 / Q8_0 tensors) stay in their blocks and are
read by the C++ kernels (`cpu_kernels/`), a fifth to a quarter of the bytes of float32; without AMX, a
step of many rows (prefill) expands them and runs one BLAS matmul, which costs less than dequantizing
per row there. Rows given as tensors load as in `DenseLinear`; a layer with some of each expands the blocks
beside the dense rows at `finish_loading` and runs dense.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_service.cpu_kernels.quant import (
    QuantizedWeight,
    QuantType,
    dequantize_rows,
    load_extension,
    quant_matmul,
)
from inference_service.model.linear import DenseLinear

# Above this many input rows a quantized layer expands its weight and runs one dense matmul, unless the
# kernels' AMX path runs it: about where the two cost the same for the embedded model on a 2-core CPU
# without AMX (bench/results/cpu-2026-11-25/README.md); the AMX path beat the dense one at every size
# measured, to 2048 rows (bench/results/cpu-2026-11-27/README.md).
MAX_QUANTIZED_MATMUL_ROWS = 48


def expands_for(num_rows: int) -> bool:
    """Whether a quantized layer runs `num_rows` input rows by expanding its weight (dense BLAS)."""
    ext = load_extension()
    return num_rows > MAX_QUANTIZED_MATMUL_ROWS and (ext is None or ext.instruction_set() != "amx")


class GGUFLinear(DenseLinear):
    """`DenseLinear`, except that rows loaded in GGUF blocks are executed in them (CPU, float32)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, output_partitions: tuple[int, ...] | None = None):
        super().__init__(in_features, out_features, bias, dtype, device, output_partitions)
        # Quantized row ranges as (first row, weight), sorted; set by `load_rows`.
        self.quantized: list[tuple[int, QuantizedWeight]] = []

    def load_rows(self, first_row: int, weight: torch.Tensor | QuantizedWeight) -> None:
        if not isinstance(weight, QuantizedWeight):
            super().load_rows(first_row, weight)
            return
        if weight.shape[1] != self.in_features or not 0 <= first_row <= self.out_features - weight.shape[0]:
            raise ValueError(f"quantized rows {weight.shape} at {first_row} do not fit [{self.out_features}, "
                             f"{self.in_features}]")
        self.quantized = sorted([*self.quantized, (first_row, weight)], key=lambda part: part[0])

    def finish_loading(self) -> None:
        """Stack neighbouring block parts of one type (q, k, v -> qkv) so a step makes one call for
        them, and release the float copy; with some rows dense, expand the blocks and pack instead."""
        if not self.quantized:
            super().finish_loading()
            return
        num_quantized = sum(weight.shape[0] for _, weight in self.quantized)
        if num_quantized != self.out_features:
            # Part of the rows came dense (a type the kernels do not run): expand the rest beside them.
            with torch.no_grad():
                for first, weight in self.quantized:
                    self.weight[first:first + weight.shape[0]].copy_(dequantize_rows(weight))
            self.quantized = []
            super().finish_loading()
            return
        merged = [self.quantized[0]]
        for first, weight in self.quantized[1:]:
            if weight.qtype is merged[-1][1].qtype:
                merged[-1] = (merged[-1][0], QuantizedWeight.concat([merged[-1][1], weight]))
            else:
                merged.append((first, weight))
        self.quantized = merged
        if not self.keeps_weight:
            self.release_weight()

    def num_weight_bytes(self) -> int:
        return super().num_weight_bytes() + sum(weight.nbytes for _, weight in self.quantized)

    def describe(self) -> dict | None:
        if not self.quantized:
            return None
        bits = max(8 if weight.qtype is QuantType.Q8_0 else 4 for _, weight in self.quantized)
        return {"format": "gguf " + "/".join(sorted({weight.qtype.name for _, weight in self.quantized})),
                "bits": bits, "group_size": 32, "num_bytes": sum(weight.nbytes for _, weight in self.quantized)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quantized:
            return super().forward(x)
        x = x.contiguous()
        if expands_for(x.shape[0]):
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
