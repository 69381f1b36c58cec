"""`QuantizedLinear`: a projection whose rows may come packed (GPTQ, AWQ, compressed-tensors, fp8, GGUF
Q-types on the GPU, in-situ `--quantization`), run by the dequantize-in-kernel Triton matmuls.

Rows arrive part by part (q, k, v of `qkv_proj`; gate, up of `gate_up_proj`) as the checkpoint reader
produced them: a packed weight (`kernels.quant_layout.IntPackedWeight`, `kernels.fp8_gemm.Fp8Weight`)
or a plain tensor (an unquantized layer: the lm_head, a module the checkpoint's config ignores).
`finish_loading` stacks the packed parts into one weight once, so a step makes one kernel call per
projection; a layer whose rows came partly plain expands the packed parts beside them (logged).

The forward has no host syncs and allocates only its output: CUDA-graph capturable. The kernels run
on CUDA, and on the CPU only under the Triton interpreter (`TRITON_INTERPRET=1`, tests); elsewhere on
the CPU the packed rows are expanded into the plain weight at load (the loader says so once).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.cpu_kernels.quant import QuantizedWeight, dequantize_rows
from inference_service.errors import UnsupportedModelError
from inference_service.model.linear import LinearBase
from inference_service.model.quant.packed_linear import dequantize_packed, packed_linear
from inference_service.model.quant.rows import concat_rows
from inference_service.model.quant.summary import PackedWeight, describe_weight
from kernels._common import is_interpreter
from kernels.fp8_gemm import Fp8Weight
from kernels.quant_layout import IntPackedWeight
from kernels.quant_tiles import with_row_tiles

logger = logging.getLogger(__name__)

_PACKED_TYPES = (IntPackedWeight, Fp8Weight)


def runs_packed(device: torch.device | str) -> bool:
    """Whether the quantized Triton kernels run on `device`: CUDA, or anything under the interpreter."""
    return torch.device(device).type == "cuda" or is_interpreter()


def _kernel_layout(weight: PackedWeight) -> PackedWeight:
    """The weight in the layout the GPU kernels stream fastest (4-bit codes in row tiles: `with_row_tiles`)."""
    return with_row_tiles(weight) if isinstance(weight, IntPackedWeight) else weight


class QuantizedLinear(LinearBase):
    """A projection kept packed where its rows came packed (`packed`), else a plain `weight` [out, in]
    in the model dtype. Implements `LinearBase` (see linear.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, output_partitions: tuple[int, ...] | None = None):
        super().__init__(in_features, out_features, bias, dtype, device, output_partitions)
        self.dtype, self.device = dtype, torch.device(device)
        # Set by `finish_loading` when every row came packed; until then the parts as (first row, weight).
        self.packed: PackedWeight | None = None
        self._packed_parts: list[tuple[int, PackedWeight]] = []
        # NOTE: the plain weight is allocated on the first plain rows only, so a quantized model never
        # holds its 16-bit size on the device, not even while loading.
        self.weight: nn.Parameter | None = None
        self._num_plain_rows = 0
        self._split_parts: list[tuple[int, PackedWeight]] | None = None  # parts run one by one (finish_loading)

    @property
    def is_packed(self) -> bool:
        return self.packed is not None

    def load_rows(self, first_row: int, weight: torch.Tensor | PackedWeight | QuantizedWeight) -> None:
        rows, cols = weight.shape
        if cols != self.in_features or not 0 <= first_row <= self.out_features - rows:
            raise ValueError(f"rows {tuple(weight.shape)} at {first_row} do not fit [{self.out_features}, "
                             f"{self.in_features}]")
        if isinstance(weight, _PACKED_TYPES):
            self._packed_parts.append((first_row, weight.to(self.device)))
            return
        if isinstance(weight, QuantizedWeight):  # GGUF blocks meant for the CPU kernels
            weight = dequantize_rows(weight)
        with torch.no_grad():
            self._plain_weight()[first_row:first_row + rows].copy_(weight)
        self._num_plain_rows += rows

    def tie_weight(self, weight: nn.Parameter) -> None:
        self.weight = weight
        self._num_plain_rows = self.out_features

    def _plain_weight(self) -> nn.Parameter:
        if self.weight is None:
            self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=self.dtype,
                                                   device=self.device), requires_grad=False)
        return self.weight

    def finish_loading(self) -> None:
        """Stack the packed parts into one weight (every row packed), or expand them beside the plain
        rows (some rows plain). A row loaded by neither is an `UnsupportedModelError`."""
        if not self._packed_parts:
            return
        parts = sorted(self._packed_parts, key=lambda part: part[0])
        num_packed = sum(w.shape[0] for _, w in parts)
        if num_packed + self._num_plain_rows != self.out_features:
            raise UnsupportedModelError(f"a projection got {num_packed} packed and {self._num_plain_rows} plain rows "
                                        f"of {self.out_features}")
        if self._num_plain_rows == 0 and runs_packed(self.device):
            expected = 0
            for first, w in parts:
                if first != expected:
                    raise UnsupportedModelError(f"packed rows start at {first}, expected {expected}")
                expected += w.shape[0]
            try:
                self.packed = _kernel_layout(concat_rows([w for _, w in parts]))
            except ValueError as e:
                # NOTE: parts that cannot share one weight (GPTQ act-order parts with different g_idx,
                # fp8 blocks that split a part) each run their own kernel into their rows of the output.
                logger.info("a projection keeps %d quantized parts apart: %s", len(parts), e)
                self._split_parts = [(first, _kernel_layout(w)) for first, w in parts]
                self.packed = self._split_parts[0][1]
        else:
            if self._num_plain_rows:
                logger.info("a projection of %d rows came %d of them quantized and %d plain: running it in %s",
                            self.out_features, num_packed, self._num_plain_rows, self.dtype)
            with torch.no_grad():
                for first, w in parts:
                    self._plain_weight()[first:first + w.shape[0]].copy_(dequantize_packed(w, self.dtype))
        self._packed_parts = []

    def dequantized_weight(self) -> torch.Tensor:
        """W [out, in] in the model dtype (the 16-bit twin of a packed weight)."""
        if self._split_parts is not None:
            return torch.cat([dequantize_packed(w, self.dtype) for _, w in self._split_parts])
        if self.packed is not None:
            return dequantize_packed(self.packed, self.dtype)
        return self.weight.detach()

    def packed_parts(self) -> list[PackedWeight]:
        """The packed weights a forward reads (one unless parts are kept apart)."""
        if self._split_parts is not None:
            return [w for _, w in self._split_parts]
        return [] if self.packed is None else [self.packed]

    def describe(self) -> dict | None:
        """`describe_weight` of the packed weight; None when plain."""
        return None if self.packed is None else describe_weight(self.packed)

    def num_weight_bytes(self) -> int:
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        return params + sum(w.nbytes for w in self.packed_parts())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._split_parts is not None:
            x = x.contiguous()
            out = torch.cat([packed_linear(x, w) for _, w in self._split_parts], dim=-1)
            return out if self.bias is None else out.add_(self.bias)
        if self.packed is not None:
            return packed_linear(x.contiguous(), self.packed, self.bias)
        if x.is_cuda and x.dim() == 2:
            from inference_service.model.fused_stack import uses_gemv  # Triton: imported on the GPU only

            if uses_gemv(x, self.weight.dtype):
                import kernels

                return kernels.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
