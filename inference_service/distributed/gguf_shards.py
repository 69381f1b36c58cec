"""Reading only a rank's shard of a GGUF file: rows (and, for row-parallel projections, whole blocks
of columns) are sliced out of the file's memory map before anything is dequantized, so a rank touches
only its part's pages. With `packed`, the projections of the types the GPU kernels run
(`GGUF_PACKED_TYPES`) come repacked from the slice's blocks, as a single-GPU load repacks whole tensors;
everything else comes dequantized to the model dtype."""

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
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # slowest-first
    if shard is None or len(shape) != 2:
        return GGUFCheckpoint._dequantize(tensor)
    if shard.is_zero:
        return np.zeros(shape, dtype=np.float32)
    parts = [_dequantize_rows(raw, tensor, num_cols) for raw, num_cols in _raw_parts(tensor, shard)]
    part = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=shard.dim)
    if shard.pad_rows is not None and part.shape[0] < shard.pad_rows:
        part = np.concatenate((part, np.zeros((shard.pad_rows - part.shape[0], part.shape[1]), np.float32)))
    return part


def read_gguf_shard_packed(tensor, shard: TensorShard | None):
    """A projection's GGUF tensor of a `GGUF_PACKED_TYPES` type -> this rank's part repacked (`IntPackedWeight`):
    its blocks are independent, so the rank's rows, or its whole blocks of columns, repack on their own."""
    from inference_service.model.quant.gguf_types import repack_gguf

    rows = int(tensor.shape[1])
    if shard is None:
        return repack_gguf(np.asarray(tensor.data).reshape(rows, -1), tensor.tensor_type.name)
    raws = [raw for raw, _ in _raw_parts(tensor, shard)]
    raw = raws[0] if len(raws) == 1 else np.concatenate(raws, axis=shard.dim)
    return repack_gguf(np.ascontiguousarray(raw), tensor.tensor_type.name)


def _raw_parts(tensor, shard: TensorShard) -> list[tuple[np.ndarray, int]]:
    """(stored rows or block columns of each of `shard`'s ranges, as views of the memory map; their number of
    columns) of a 2-D GGUF tensor. A column split inside a quantization block is refused naming the tensor."""
    import gguf

    rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data).reshape(rows, -1)  # a view of the memory map: nothing read yet
    kind = tensor.tensor_type.name
    parts = []
    for start, stop in shard.ranges:
        if shard.dim == 0:
            parts.append((data[start:stop], cols))
        elif kind in ("F32", "F16"):
            parts.append((data[:, start:stop], stop - start))
        else:
            block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
            if start % block_size or stop % block_size:
                raise UnsupportedModelError(f"GGUF tensor {tensor.name!r} ({kind}, blocks of {block_size}) cannot be "
                                            f"split at column {start if start % block_size else stop} for tensor "
                                            f"parallelism")
            parts.append((data[:, start // block_size * type_size:stop // block_size * type_size], stop - start))
    return parts


class ShardedGGUF:
    """Iterates (HF name, this rank's slice in `dtype`, or with `packed` a projection's repacked blocks) over a
    GGUF checkpoint."""

    def __init__(self, checkpoint: GGUFCheckpoint, plan: ShardPlan, dtype: torch.dtype, packed: bool = False):
        self.checkpoint, self.plan, self.dtype, self.packed = checkpoint, plan, dtype, packed

    def __iter__(self) -> Iterator[tuple[str, object]]:
        from inference_service.model.quant.gguf_types import GGUF_PACKED_TYPES
        from inference_service.model.quant.loading import IN_SITU_PROJECTIONS
        from inference_service.model.quant.rows import select_rows

        is_permuted = self.checkpoint.architecture == "llama"
        for name, tensor in self.checkpoint._tensors.items():
            if name == ROPE_FREQS:
                continue
            hf_name = hf_tensor_name(name)
            # llama.cpp permutes rows within each head: the rank's whole heads unpermute on their own.
            num_heads = None
            if is_permuted and ".self_attn.q_proj." in hf_name:
                num_heads = self.plan.num_local_heads
            elif is_permuted and ".self_attn.k_proj." in hf_name:
                num_heads = self.plan.num_local_kv_heads
            if (self.packed and tensor.tensor_type.name in GGUF_PACKED_TYPES and len(tensor.shape) == 2
                    and hf_name.split(".")[-2] in IN_SITU_PROJECTIONS):
                weight = read_gguf_shard_packed(tensor, self.plan.shard_of(hf_name))
                if num_heads is not None:
                    weight = select_rows(weight, unpermute_rope_rows(np.arange(weight.shape[0]), num_heads))
                yield hf_name, weight
                continue
            array = read_gguf_shard(tensor, self.plan.shard_of(hf_name))
            if num_heads is not None:
                array = unpermute_rope_rows(array, num_heads)
            yield hf_name, torch.from_numpy(np.ascontiguousarray(array)).to(self.dtype)
