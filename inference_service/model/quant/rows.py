"""Row operations on packed weights, for a Linear loaded part by part: q, k, v (or gate, up) stacked
into one fused projection, and rows picked / reordered (llama.cpp's q/k row order undone)."""

from __future__ import annotations

import numpy as np
import torch

from inference_service.model.quant.summary import PackedWeight
from kernels.fp8_gemm import Fp8Weight
from kernels.quant_layout import IntPackedWeight
from kernels.quant_tiles import row_major_qs


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """The parts' rows stacked in order. Integer parts must share bits, group size, columns and
    act-order permutation (GPTQ's follows the shared input, so q/k/v and gate/up agree); a part's
    constant zero becomes a zeros plane where the parts' zeros differ. fp8 parts must share the
    column block; per-tensor scales become per-row ones, so every part keeps its own."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if all(isinstance(p, IntPackedWeight) for p in parts):
        return _concat_int(parts)
    if all(isinstance(p, Fp8Weight) for p in parts):
        return _concat_fp8(parts)
    raise ValueError(f"cannot stack weights of different formats: {[type(p).__name__ for p in parts]}")


def _concat_int(parts: list[IntPackedWeight]) -> IntPackedWeight:
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.shape[1]) != (first.bits, first.group_size, first.shape[1]):
            raise ValueError(f"cannot stack {p.bits}-bit group {p.group_size} [{p.shape[1]} columns] onto "
                             f"{first.bits}-bit group {first.group_size} [{first.shape[1]} columns]")
        if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            raise ValueError("cannot stack weights with different act-order permutations (g_idx)")
    if any((p.offsets is None) != (first.offsets is None) for p in parts):
        raise ValueError("cannot stack weights with and without offsets")

    def cat(name: str) -> torch.Tensor | None:
        tensors = [row_major_qs(p) if name == "qs" else getattr(p, name) for p in parts]
        return None if tensors[0] is None else torch.cat(tensors)

    zeros, zero = None, first.zero
    if any(p.zeros is not None for p in parts) or any(p.zero != first.zero for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.full_like(p.scales, p.zero, dtype=torch.uint8)
                           for p in parts])
    scale_dtype = first.scales.dtype if all(p.scales.dtype == first.scales.dtype for p in parts) else torch.float32
    return IntPackedWeight(first.bits, first.group_size, cat("qs"), torch.cat([p.scales.to(scale_dtype) for p in parts]),
                           qh=cat("qh"), zeros=zeros, zero=zero, offsets=cat("offsets"), perm=first.perm)


def _concat_fp8(parts: list[Fp8Weight]) -> Fp8Weight:
    k = parts[0].shape[1]
    block_k = parts[0].block_k
    is_block = [p.is_block_wise for p in parts]
    if any(is_block):
        block_n = parts[0].block_n
        for p in parts:
            if not p.is_block_wise or (p.block_n, p.block_k) != (block_n, block_k) or p.shape[0] % block_n:
                raise ValueError(f"cannot stack fp8 blocks {(p.block_n, p.block_k)} of {p.shape[0]} rows onto "
                                 f"blocks {(block_n, block_k)}: rows must fill whole blocks")
        return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), block_n, block_k)
    per_row = [p.scale.expand(p.shape[0], 1) if p.block_n == p.shape[0] else p.scale for p in parts]
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat(per_row).contiguous(), 1, k)


def select_rows(w: PackedWeight, index: np.ndarray | torch.Tensor) -> PackedWeight:
    """The weight with rows picked / reordered by `index` (llama.cpp's q/k row order undone)."""
    index = torch.as_tensor(np.ascontiguousarray(index), dtype=torch.int64)

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index.to(t.device)).contiguous()

    if isinstance(w, Fp8Weight):
        if w.block_n != 1:
            raise ValueError("rows of an fp8 weight with block or per-tensor scales cannot be reordered")
        return Fp8Weight(pick(w.weight), pick(w.scale), 1, w.block_k)
    return IntPackedWeight(w.bits, w.group_size, pick(row_major_qs(w)), pick(w.scales), qh=pick(w.qh),
                           zeros=pick(w.zeros), zero=w.zero, offsets=pick(w.offsets), perm=w.perm)
