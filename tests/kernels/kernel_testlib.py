"""Shared helpers for the kernel tests: mode, tolerances, paged-cache builders, error checks."""

from __future__ import annotations

import os

import torch

from kernels import FP8_DTYPE, write_kv_cache_ref

# Compiled on the GPU (full grid) or interpreted on the CPU (small grid for CI).
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")

# Relative error ||out - ref|| / ||ref|| against a float64 reference.
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# fp8 e4m3 K/V: 3 mantissa bits, ~3% per value; attention averages it down.
FP8_ATTN_TOL = 5e-2

DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", FP8_DTYPE: "fp8"}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; fails on any non-finite output (poisoned or unwritten)."""
    out = out.to(torch.float64)
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} non-finite outputs"
    denom = ref.to(torch.float64).norm().item()
    return (out - ref).norm().item() / max(denom, 1e-30)


def poisoned(shape, dtype, device=DEVICE) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def random_seq_block_tables(
    seq_lens: list[int], page_size: int, num_blocks: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Distinct random blocks per sequence (block 0 reserved as the padding target), padded with 0."""
    needed = [-(-n // page_size) for n in seq_lens]
    max_blocks = max(max(needed, default=1), 1) + 1  # one spare column of padding
    assert sum(needed) < num_blocks
    perm = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    table = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(needed):
        table[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    return table


def slots_for(block_table: torch.Tensor, num_tokens: int, page_size: int) -> torch.Tensor:
    """Slots of a sequence's tokens 0..num_tokens-1 [num_tokens] int64."""
    pos = torch.arange(num_tokens, device=block_table.device)
    return block_table.long()[pos // page_size] * page_size + pos % page_size


class PagedKV:
    """A paged K/V cache holding `seq_lens[i]` random tokens per sequence.

    Every slot no sequence owns (block 0, the tails of last blocks, spare blocks) is NaN, so a
    kernel that reads outside a context produces NaN."""

    def __init__(
        self,
        seq_lens: list[int],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        cache_dtype: torch.dtype | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        spare_blocks: int = 3,
    ):
        cache_dtype = cache_dtype or dtype
        num_blocks = sum(-(-n // page_size) for n in seq_lens) + spare_blocks + 1
        shape = (num_blocks, page_size, num_kv_heads, head_dim)
        self.k_cache = poisoned(shape, cache_dtype)
        self.v_cache = poisoned(shape, cache_dtype)
        self.block_tables = random_seq_block_tables(seq_lens, page_size, num_blocks).to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.k_scale, self.v_scale = k_scale, v_scale
        slots = [slots_for(self.block_tables[i], n, page_size) for i, n in enumerate(seq_lens)]
        total = sum(seq_lens)
        # K/V values of a real model's size: scale chosen so fp8 uses its range without saturating.
        k = torch.randn(total, num_kv_heads, head_dim, device=DEVICE).to(dtype)
        v = torch.randn(total, num_kv_heads, head_dim, device=DEVICE).to(dtype)
        slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64, device=DEVICE)
        write_kv_cache_ref(k, v, self.k_cache, self.v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
