"""GGUF Q4_0 / Q4_1 / Q8_0 weights executed in place on the CPU (a C++ extension, `quant_matmul.cpp`).

`QuantizedWeight.from_gguf_blocks` splits a tensor's GGUF blocks once at load into the layout the
kernels read (quants, scales and mins as stored, in separate arrays); `quant_matmul` multiplies fp32
activations by it, dequantizing each block in registers; `dequantize_rows` expands chosen rows (the
embedding lookup, and prefill, where a dense BLAS matmul over an expanded weight wins). The `*_ref`
functions are the float64 references the tests use.

How the extension is built and loaded: `build.py`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import numpy as np
import torch

from inference_service.cpu_kernels.build import cpu_ops_for, load_extension

__all__ = ["BLOCK_SIZE", "QuantType", "QuantizedWeight", "cpu_ops_for", "dequantize_ref", "dequantize_rows",
           "load_extension", "quant_matmul", "quant_matmul_ref"]

BLOCK_SIZE = 32


class QuantType(enum.IntEnum):
    """GGUF block types the kernels execute (values are the C++ enum's)."""

    Q4_0 = 0
    Q4_1 = 1
    Q8_0 = 2

    @property
    def quant_bytes(self) -> int:
        """Bytes of quants in one 32-element block."""
        return 32 if self is QuantType.Q8_0 else 16

    @property
    def block_bytes(self) -> int:
        """Bytes of one GGUF block: fp16 scale (and Q4_1's fp16 min), then the quants."""
        return 2 + (2 if self is QuantType.Q4_1 else 0) + self.quant_bytes


@dataclass
class QuantizedWeight:
    """A [rows, cols] weight kept in GGUF blocks: `qs` [rows, cols / 32 * QB] uint8, `scales` (d) and,
    for Q4_1, `mins` (m), each [rows, cols / 32] float16 as the file stores them."""

    qtype: QuantType
    qs: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor  # empty unless Q4_1

    def __post_init__(self) -> None:
        rows, num_blocks = self.scales.shape
        if tuple(self.qs.shape) != (rows, num_blocks * self.qtype.quant_bytes):
            raise ValueError(f"{self.qtype.name} quants of shape {tuple(self.qs.shape)} do not match "
                             f"scales {tuple(self.scales.shape)}")
        if self.qtype is QuantType.Q4_1 and self.mins.shape != self.scales.shape:
            raise ValueError("Q4_1 needs one min per block")

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scales.nbytes + self.mins.nbytes

    @classmethod
    def from_gguf_blocks(cls, blocks: np.ndarray, qtype: QuantType) -> QuantizedWeight:
        """`blocks` [rows, num_blocks * block_bytes] uint8, a GGUF tensor's raw data row by row."""
        rows = blocks.shape[0]
        grouped = np.ascontiguousarray(blocks).reshape(rows, -1, qtype.block_bytes)  # [R, B, block_bytes]
        scales = np.ascontiguousarray(grouped[:, :, 0:2]).view(np.float16)[:, :, 0]
        mins = (np.ascontiguousarray(grouped[:, :, 2:4]).view(np.float16)[:, :, 0]
                if qtype is QuantType.Q4_1 else np.zeros((0,), np.float16))
        qs = grouped[:, :, qtype.block_bytes - qtype.quant_bytes:].reshape(rows, -1)
        return cls(qtype, torch.from_numpy(np.ascontiguousarray(qs)), torch.from_numpy(np.ascontiguousarray(scales)),
                   torch.from_numpy(np.ascontiguousarray(mins)))

    def select_rows(self, index: np.ndarray) -> QuantizedWeight:
        """The weight with its rows reordered / picked by `index` (e.g. undoing llama.cpp's q/k row order)."""
        index = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        mins = self.mins.index_select(0, index) if self.mins.numel() else self.mins
        return QuantizedWeight(self.qtype, self.qs.index_select(0, index), self.scales.index_select(0, index), mins)

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one type and width stacked (fused qkv, gate_up)."""
        qtype = parts[0].qtype
        if any(p.qtype is not qtype for p in parts):
            raise ValueError("cannot stack weights of different quant types")
        mins = torch.cat([p.mins for p in parts]) if qtype is QuantType.Q4_1 else parts[0].mins
        return QuantizedWeight(qtype, torch.cat([p.qs for p in parts]), torch.cat([p.scales for p in parts]), mins)


def quant_matmul(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] float32 (rows contiguous) @ dequant(weight)[R, K]^T -> out [N, R] float32.

    `out` may be a column slice of a wider tensor (its rows contiguous)."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU quantized-matmul extension is not available")
    if out is None:
        return ext.quant_matmul_new(x, weight.qs, weight.scales, weight.mins, int(weight.qtype))
    ext.quant_matmul(x, weight.qs, weight.scales, weight.mins, int(weight.qtype), out)
    return out


def dequantize_rows(weight: QuantizedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """dequant(weight)[rows] as float32 [len(rows), K]; every row when `rows` is None."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU quantized-matmul extension is not available")
    index = torch.empty(0, dtype=torch.int64) if rows is None else rows
    return ext.dequantize_rows(weight.qs, weight.scales, weight.mins, int(weight.qtype), index)


def dequantize_ref(weight: QuantizedWeight) -> torch.Tensor:
    """float64 [R, K]: the block formulas written out in torch (the reference of the kernels)."""
    qs, rows = weight.qs.long(), weight.shape[0]
    if weight.qtype is QuantType.Q8_0:
        q = torch.where(qs >= 128, qs - 256, qs).view(rows, -1, 32)
    else:
        q = torch.cat([qs.view(rows, -1, 16) & 0x0F, qs.view(rows, -1, 16) >> 4], dim=2)  # [R, B, 32]
    d = weight.scales.double()[:, :, None]
    if weight.qtype is QuantType.Q4_0:
        w = d * (q - 8).double()
    elif weight.qtype is QuantType.Q4_1:
        w = d * q.double() + weight.mins.double()[:, :, None]
    else:
        w = d * q.double()
    return w.reshape(rows, -1)


def quant_matmul_ref(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """float64 x @ dequant(weight)^T."""
    return x.double() @ dequantize_ref(weight).T


if __name__ == "__main__":  # the install step: compile once, so the first server start does not
    logging.basicConfig(level=logging.INFO)
    ext = load_extension()
    print(f"CPU quantized matmul: {'built, ' + ext.instruction_set() if ext else 'NOT available'}")
