"""Reading only a rank's shard of a safetensors checkpoint: `safe_open(...).get_slice(name)[rows]`
reads the slice's bytes from the memory map; the full tensor is never materialized."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from inference_service.distributed.sharding import ShardPlan, TensorShard


def read_shard(tensor_slice, shard: TensorShard | None, dtype: torch.dtype | None) -> torch.Tensor:
    """A safetensors `PySafeSlice` (or anything indexable the same way with `get_shape()`) -> this
    rank's part in `dtype` (None: as stored)."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t if dtype is None else t.to(dtype)

    shape = list(tensor_slice.get_shape())
    if shard is None:
        return cast(tensor_slice[:])
    if shard.is_zero:
        return torch.zeros(shape, dtype=dtype)
    parts = []
    for start, stop in shard.ranges:
        index = (slice(start, stop),) if shard.dim == 0 else (slice(None), slice(start, stop))
        parts.append(cast(tensor_slice[index]))
    part = parts[0] if len(parts) == 1 else torch.cat(parts, dim=shard.dim)
    if shard.pad_rows is not None and part.shape[0] < shard.pad_rows:
        padding = torch.zeros((shard.pad_rows - part.shape[0], *part.shape[1:]), dtype=part.dtype)
        part = torch.cat((part, padding))
    return part


class ShardedSafetensors:
    """Iterates (name, this rank's slice) over safetensors files."""

    def __init__(self, files: list[str], plan: ShardPlan, dtype: torch.dtype,
                 ignored_suffixes: tuple[str, ...] = ()):
        self.files, self.plan, self.dtype, self.ignored_suffixes = files, plan, dtype, ignored_suffixes

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.endswith(self.ignored_suffixes):
                        continue
                    part = read_shard(f.get_slice(name), self.plan.shard_of(name), self.dtype)
                    yield name, part

