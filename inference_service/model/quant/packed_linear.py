"""A linear layer's matmul over a packed weight, for the GPU model: the one call a quantized Linear
variant makes, whatever the format (`IntPackedWeight` -> `kernels.quant_matmul`, `Fp8Weight` ->
`kernels.fp8_linear`), and the 16-bit twin of a packed weight (for `--dequantize` and for checks)."""

from __future__ import annotations

import torch

from inference_service.model.quant.summary import PackedWeight
from kernels.fp8_gemm import Fp8Weight, dequantize_fp8, fp8_linear
from kernels.quant_gemm import quant_matmul
from kernels.quant_gemv import gemv_faster_rows
from kernels.quant_layout import dequantize_int


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, *,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight).T + bias (+ residual [..., N]) -> [..., N] in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    n = weight.shape[0]
    if isinstance(weight, Fp8Weight):
        y = fp8_linear(rows, weight, bias, residual=None if residual is None else residual.reshape(-1, n))
    elif residual is not None and rows.shape[0] > gemv_faster_rows(weight):  # the GEMM takes no residual
        y = quant_matmul(rows, weight, bias)
        y += residual.reshape(-1, n)
    else:
        y = quant_matmul(rows, weight, bias, residual=None if residual is None else residual.reshape(-1, n))
    return y.reshape(*x.shape[:-1], n)


def dequantize_packed(weight: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] expanded to `dtype` (columns in the checkpoint's order)."""
    if isinstance(weight, Fp8Weight):
        return dequantize_fp8(weight, torch.float32).to(dtype)
    return dequantize_int(weight, torch.float32).to(dtype)
