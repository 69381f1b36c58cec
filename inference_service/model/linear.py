"""The Linear interface every projection implements, and its dense variant.

`LinearBase` is the seam the model's projections share: y = x W^T + b with Hugging Face's [out, in]
weight. A variant decides how W is stored and multiplied:

    DenseLinear   model dtype; on the CPU re-laid out once for oneDNN ("packed", below)
    GGUFLinear    rows given in GGUF Q4_0 / Q4_1 / Q8_0 blocks run in them (C++ kernels, CPU; gguf_linear.py)
    GemvLinear    dense, a few bf16/fp16 rows through `kernels.gemv` (the fused GPU path; fused_stack.py)

How a new variant (a GPU quantized format, a tensor-parallel shard) plugs in:

  * subclass `LinearBase` and implement `load_rows`, `forward`, `num_weight_bytes`, and
    `finish_loading` if the loaded rows need converting (repacking, merging parts);
  * `load_rows(first_row, weight)` gets the rows [first_row, first_row + rows) of W as the checkpoint
    reader produced them: a tensor, or a format object (like `QuantizedWeight`) the variant knows;
    `output_partitions` says which rows belong together (q, k, v of `qkv_proj`; gate, up of
    `gate_up_proj`), so a sharded variant can take its slice of each partition;
  * biases come through `load_bias_rows` into the `bias` parameter (override to shard them);
  * pass the class to `DecoderModel(linear_cls=...)`: it is called as
    `cls(in_features, out_features, bias, dtype, device, output_partitions=...)` for every projection.

Why pack on the CPU: decode there is bound by how fast the weights stream through the matmul. MKL's
sgemm on the row-major [out, in] weight reaches about half the machine's read bandwidth at batch 1;
oneDNN with the weight re-laid out for its blocked kernels reaches nearly all of it, and is also
faster at batch 4-16. So after loading, CPU weights are packed and the plain copy is released.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.cpu_kernels.quant import QuantizedWeight, dequantize_rows
from inference_service.errors import UnsupportedModelError

# Packing is tuned for a batch of this many rows; other batch sizes still run, a little slower.
_PACK_BATCH_HINT = 16


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            # NOTE: oneDNN's bf16 reorder needs AVX512-BF16/AVX-NE-CONVERT-class CPUs; elsewhere bf16 stays plain.
            and (weight.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class LinearBase(nn.Module):
    """A projection x [N, in_features] -> [N, out_features], loaded by rows (see the module docstring).

    `output_partitions`: the row counts of the parts a checkpoint may store as separate tensors, in
    order (their sum is `out_features`); one part for a plain projection."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, output_partitions: tuple[int, ...] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.output_partitions = tuple(output_partitions or (out_features,))
        if sum(self.output_partitions) != out_features:
            raise ValueError(f"output_partitions {self.output_partitions} do not add up to {out_features} rows")
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def partition_rows(self, index: int | None) -> tuple[int, int]:
        """(first row, number of rows) of partition `index`; None: every row."""
        if index is None:
            return 0, self.out_features
        return sum(self.output_partitions[:index]), self.output_partitions[index]

    def load_rows(self, first_row: int, weight: torch.Tensor | QuantizedWeight) -> None:
        """Rows [first_row, first_row + rows) of W [out, in]."""
        raise NotImplementedError

    def load_bias_rows(self, first_row: int, bias: torch.Tensor) -> None:
        """Entries [first_row, first_row + rows) of the bias."""
        with torch.no_grad():
            self.bias[first_row:first_row + bias.shape[0]].copy_(bias)

    def tie_weight(self, weight: nn.Parameter) -> None:
        """Use the embedding's [vocab, H] parameter as W (a tied lm_head)."""
        raise UnsupportedModelError(f"{type(self).__name__} cannot share the embedding's weight")

    def finish_loading(self) -> None:
        """Called once every row is loaded: convert them to the layout `forward` reads."""

    def num_weight_bytes(self) -> int:
        """Bytes a forward reads: W in whatever form it is kept, and the bias."""
        raise NotImplementedError

    def describe(self) -> dict | None:
        """{"format", "bits", ...} of W where it is kept quantized; None where it is plain."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in_features] -> [N, out_features]."""
        raise NotImplementedError


class DenseLinear(LinearBase):
    """W as a parameter `weight` [out, in] in the model dtype; packed for oneDNN on the CPU once loaded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, output_partitions: tuple[int, ...] | None = None):
        super().__init__(in_features, out_features, bias, dtype, device, output_partitions)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self._packed: torch.Tensor | None = None  # oneDNN blocked copy of `weight`
        # Whether `finish_loading` keeps the plain weight beside the packed one (a tied lm_head: the
        # embedding's lookups still read it).
        self.keeps_weight = False

    def load_rows(self, first_row: int, weight: torch.Tensor | QuantizedWeight) -> None:
        rows = weight.shape[0]
        if weight.shape[1] != self.in_features or not 0 <= first_row <= self.out_features - rows:
            raise ValueError(f"rows {tuple(weight.shape)} at {first_row} do not fit [{self.out_features}, "
                             f"{self.in_features}]")
        if isinstance(weight, QuantizedWeight):
            weight = dequantize_rows(weight)
        with torch.no_grad():
            self.weight[first_row:first_row + rows].copy_(weight)

    def tie_weight(self, weight: nn.Parameter) -> None:
        self.weight = weight
        self.keeps_weight = True

    def finish_loading(self) -> None:
        """Re-lay the weight out for oneDNN (CPU only; elsewhere nothing to do). Unless `keeps_weight`,
        the plain weight's storage is freed: the layer can no longer be re-loaded."""
        if self._packed is not None or not can_pack(self.weight):
            return
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_BATCH_HINT)
        if not self.keeps_weight:
            self.release_weight()

    def release_weight(self) -> None:
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def num_weight_bytes(self) -> int:
        packed = 0 if self._packed is None else self._packed.numel() * self._packed.element_size()
        return packed + sum(p.numel() * p.element_size() for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
