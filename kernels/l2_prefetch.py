"""Weights pulled into L2 while a small decode batch's attention leaves the memory bus idle.

At batch 1, between a layer's qkv and o projections, the decode attention reads a few KB of KV cache a
sequence for ~10 us with the HBM next to idle, and the quantized GEMVs that follow are bound by their
latency more than by the bus (int4 ~1.6 TB/s on an H100 and on an H200 alike). A small kernel launched
beside the attention, on a stream of its own, asks the memory system to bring the next projections' first
bytes (o, then the start of gate_up) into L2 (`cp.async.bulk.prefetch.L2`, Hopper and later: one
instruction a chunk, no registers or shared memory held), so those GEMVs find part of their weight on
chip. Its programs stay resident until their chunks have arrived (H200: ~7 us for 32 MB in 4 KB chunks,
13 us in 16 KB ones), which is why it runs beside the attention rather than before it. A prefetch is a
hint: it never changes a result. The fused stack plans it for quantized weights on one GPU only
(`model/fused_stack.py`): 16-bit weights already stream near the copy rate at batch 1.

The chunks are planned once, at load (`PrefetchPlan`): addresses are fixed for the life of the weights,
so the launch is CUDA-graph capturable and does no host work beyond the launch itself.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreter

CHUNK_BYTES = 4 << 10  # one bulk prefetch; 16-byte aligned, a multiple of 16 (the instruction's rules)
CHUNKS_PER_PROGRAM = 128  # one chunk a thread
# Past this many sequences a step's attention reads enough KV cache (~4 MB a layer for a 1k-token context of
# Llama-3-8B in bf16) to keep the bus busy itself.
MAX_PREFETCH_ROWS = 4
# Of the device's L2, what a layer's prefetch fills by default (KERNELS_L2_PREFETCH_MB overrides). H200 (60 MB of L2),
# batch-1 decode of Llama-3-8B, int4 / fp8 / bf16 tok/s: none 337.2 / 259.5 / 248.1; 8 MB 343.2 / 262.3 / 249.2;
# 16 MB 345.4 / 263.3 / 248.4; 36 MB 340.8 / 260.9 / 246.4 (bench/results/h200-2026-11-28).
L2_SHARE = 0.25


@triton.jit
def _prefetch_l2_kernel(table_ptr, num_chunks, BLOCK: tl.constexpr):
    # table [num_chunks, 2] int64: (address, bytes) of each chunk
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_chunks
    address = tl.load(table_ptr + 2 * offs, mask=mask, other=0)
    size = tl.load(table_ptr + 2 * offs + 1, mask=mask, other=0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address, size], dtype=tl.int32, is_pure=False, pack=1)


def can_prefetch_l2(device: torch.device) -> bool:
    """Whether `PrefetchPlan.launch` does anything on `device`: a compiled CUDA run on Hopper or later."""
    if device.type != "cuda" or is_interpreter():
        return False
    return _is_hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _is_hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def default_prefetch_bytes(device: torch.device) -> int:
    """Bytes a layer may prefetch: `KERNELS_L2_PREFETCH_MB` if set (0 turns prefetching off), else
    `L2_SHARE` of the device's L2; 0 where `can_prefetch_l2` is false."""
    if not can_prefetch_l2(device):
        return 0
    if "KERNELS_L2_PREFETCH_MB" in os.environ:
        return int(float(os.environ["KERNELS_L2_PREFETCH_MB"]) * (1 << 20))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).L2_cache_size * L2_SHARE)


def plan_chunks(tensors: Sequence[torch.Tensor], max_bytes: int, chunk_bytes: int = CHUNK_BYTES
                ) -> list[tuple[int, int]]:
    """(address, bytes) chunks covering the first `max_bytes` of `tensors` taken in order, each tensor from
    its start. Every chunk starts 16-byte aligned and is a multiple of 16 bytes (an unaligned head and a
    tail under 16 bytes are left out)."""
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes: a positive multiple of 16, got {chunk_bytes}")
    chunks, budget = [], max_bytes
    for tensor in tensors:
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        address = -(-start // 16) * 16
        end = min(end, address + max(budget, 0)) // 16 * 16
        while address < end:
            size = min(chunk_bytes, end - address)
            chunks.append((address, size))
            budget -= size
            address += size
    return chunks


class PrefetchPlan:
    """The chunks of one prefetch launch, as a [C, 2] int64 table on the weights' device."""

    def __init__(self, tensors: Sequence[torch.Tensor], max_bytes: int, chunk_bytes: int = CHUNK_BYTES):
        chunks = plan_chunks(tensors, max_bytes, chunk_bytes)
        device = tensors[0].device if tensors else torch.device("cpu")
        self.num_bytes = sum(size for _, size in chunks)
        self.table = torch.tensor(chunks, dtype=torch.int64, device=device).reshape(-1, 2)  # [C, 2]
        self.is_launchable = bool(chunks) and can_prefetch_l2(device)

    def launch(self) -> None:
        """Issues the prefetches (nothing where there are no chunks, or `can_prefetch_l2` is false)."""
        if not self.is_launchable:
            return
        num_chunks = self.table.shape[0]
        grid = (triton.cdiv(num_chunks, CHUNKS_PER_PROGRAM),)
        _prefetch_l2_kernel[grid](self.table, num_chunks, BLOCK=CHUNKS_PER_PROGRAM, num_warps=4)
