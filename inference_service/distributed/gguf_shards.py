"""Reading only a rank's shard of a GGUF file: rows (and, for row-parallel projections, whole blocks
of columns) are sliced out of the file's memory map before anything is dequantized, so a rank touches
only its part's pages. Shards come dequantized to the model dtype (the engine's GPU path runs dense
weights; GGUF blocks run in place only on the single-process CPU path)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from inference_service.distributed.sharding import ShardPlan, TensorShard
from inference_service.errors import UnsupportedModelError
from inference_service.model.gguf_loader import ROPE_FREQS, GGUFCheckpoint, hf_tensor_name, unpermute_rope_rows


def _dequantize_rows(raw: np.ndarray, tensor, num_cols: int) -> np.ndarray:
    """raw [rows, bytes or elements of `num_cols` columns] of `tensor`'s type -> float32 [rows, num_cols]."""
    import gguf

    kind = tensor.tensor_type.name
    if kind in ("F32", "F16"):
        return np.asarray(raw, dtype=np.float32).reshape(raw.shape[0], num_cols)
    return gguf.quants.dequantize(np.ascontiguousarray(raw), tensor.tensor_type).reshape(raw.shape[0], num_cols)


def read_gguf_shard(tensor, shard: TensorShard | None) -> np.ndarray:
    """A GGUF tensor (gguf's `ReaderTensor`) -> this rank's part, float32, [rows, cols] (or [n])."""
    import gguf

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # slowest-first
    if shard is None or len(shape) != 2:
        return GGUFCheckpoint._dequantize(tensor)
    if shard.is_zero:
        return np.zeros(shape, dtype=np.float32)
    rows, cols = shape
    data = np.asarray(tensor.data).reshape(rows, -1)  # a view of the memory map: nothing read yet
    parts = []
    for start, stop in shard.ranges:
        if shard.dim == 0:
            parts.append(_dequantize_rows(data[start:stop], tensor, cols))
            continue
        kind = tensor.tensor_type.name
        if kind in ("F32", "F16"):
            parts.append(_dequantize_rows(data[:, start:stop], tensor, stop - start))
            continue
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        if start % block_size or stop % block_size:
            raise UnsupportedModelError(f"GGUF tensor {tensor.name!r} ({kind}, blocks of {block_size}) cannot be split "
                                        f"at column {start if start % block_size else stop} for tensor parallelism")
        first, last = start // block_size * type_size, stop // block_size * type_size
        parts.append(_dequantize_rows(data[:, first:last], tensor, stop - start))
    part = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=shard.dim)
    if shard.pad_rows is not None and part.shape[0] < shard.pad_rows:
        part = np.concatenate((part, np.zeros((shard.pad_rows - part.shape[0], part.shape[1]), np.float32)))
    return part


class ShardedGGUF:
    """Iterates (HF name, this rank's slice in `dtype`) over a GGUF checkpoint."""

    def __init__(self, checkpoint: GGUFCheckpoint, plan: ShardPlan, dtype: torch.dtype):
        self.checkpoint, self.plan, self.dtype = checkpoint, plan, dtype

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        is_permuted = self.checkpoint.architecture == "llama"
        for name, tensor in self.checkpoint._tensors.items():
            if name == ROPE_FREQS:
                continue
            hf_name = hf_tensor_name(name)
            array = read_gguf_shard(tensor, self.plan.shard_of(hf_name))
            # llama.cpp permutes rows within each head: the rank's whole heads unpermute on their own.
            if is_permuted and ".self_attn.q_proj." in hf_name:
                array = unpermute_rope_rows(array, self.plan.num_local_heads)
            elif is_permuted and ".self_attn.k_proj." in hf_name:
                array = unpermute_rope_rows(array, self.plan.num_local_kv_heads)
            yield hf_name, torch.from_numpy(np.ascontiguousarray(array)).to(self.dtype)
