"""The decoder's norms: RMSNorm (plain, or Gemma's (1 + weight) form) and LayerNorm with a bias (StableLM).

Both take the residual add in front of them (`forward(x, add=)`), so a layer adds and normalizes in
one call (one C++ call for float32 RMSNorm on the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.cpu_kernels.quant import cpu_ops_for


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """(weight + offset) * x / rms(x), over the last dimension (same rounding as HF's RMSNorms in fp32).

    `weight` holds the checkpoint's values. With `offset` (Gemma's 1.0) the effective scale
    weight + offset is computed once, by `prepare()` after the weights are loaded, in float32 as HF
    does; the C++ kernel and `F.rms_norm` then take it as an ordinary weight."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str, offset: float = 0.0):
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps, self.offset = eps, offset
        self.shape = (dim,)
        self._offset_scale: torch.Tensor | None = None  # weight + offset, once `prepare()`d
        self._cpu_ops = cpu_ops_for(self.weight)

    def prepare(self) -> None:
        """Fold the offset into the scale (call after every change of `weight`)."""
        if self.offset:
            scale = self.weight.float() + self.offset
            # Gemma scales in float32 and rounds once; the float32 path keeps the model dtype.
            self._offset_scale = scale.contiguous()

    @property
    def scale(self) -> torch.Tensor:
        """The effective scale the norm multiplies by."""
        return self.weight if self._offset_scale is None else self._offset_scale

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> normed [..., H]. With `add`, x += add in place first (the residual stream)."""
        if self._cpu_ops is not None and x.dim() == 2 and x.is_contiguous():
            return self._cpu_ops.add_rms_norm(x, add, self.scale, self.eps)
        if add is not None:
            x.add_(add)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.scale, self.eps)
        if self.offset:
            return F.rms_norm(x.float(), self.shape, self.scale, self.eps).to(x.dtype)
        # Lower precision: normalize in fp32 like HF, then scale in the model dtype.
        normed = F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
        return self.weight * normed


class LayerNorm(nn.Module):
    """torch's LayerNorm with weight and bias (HF's `nn.LayerNorm`), with the same residual-add front."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str, offset: float = 0.0):
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.bias = _param(dim, dtype=dtype, device=device)
        self.eps, self.shape = eps, (dim,)

    def prepare(self) -> None:
        pass

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        if add is not None:
            x.add_(add)
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)
