"""A tensor-parallel rank's part of a quantized checkpoint (GPTQ, AWQ, compressed-tensors, FP8), still packed.

A rank's share of a quantized layer is the share of its logical [N out, K in] weight that `ShardPlan` gives
(`shard_of(prefix + ".weight")`: output rows for column-parallel layers, input columns for row-parallel
ones). Each stored tensor holds N and K on its own axes, packed or grouped by its own factor (GPTQ's
qweight [K/8, N], AWQ's [K, N/8], a group's one scale, an FP8 block's one scale); the rank reads the
same share of each along its axis, divided by that factor. A split that falls inside a packed word, a
group or a block cannot be read that way and stops the load naming the tensor. A tensor with no such
axis, or one of size 1 there (a per-tensor scale, a per-channel scale of a row-parallel layer), is read
whole. The slices then go through the single-process packing (`quant/checkpoint.py`) unchanged.
"""

from __future__ import annotations

import torch

from inference_service.distributed.shard_reader import read_shard
from inference_service.distributed.sharding import ShardPlan, TensorShard
from inference_service.errors import UnsupportedModelError
from inference_service.model.quant.config import QuantMethod, QuantSpec

# Per method and stored tensor: (its axis of the output channels N, its axis of the inputs K); None: none.
_AXES = {
    QuantMethod.GPTQ: {"qweight": (1, 0), "qzeros": (1, 0), "scales": (1, 0), "g_idx": (None, 0)},
    QuantMethod.AWQ: {"qweight": (1, 0), "qzeros": (1, 0), "scales": (1, 0)},
    QuantMethod.PACKED_INT: {"weight_packed": (0, 1), "weight_scale": (0, 1), "weight_zero_point": (0, 1),
                             "weight_shape": (None, None)},
    QuantMethod.FP8: {"weight": (0, 1), "weight_scale": (0, None), "weight_scale_inv": (0, 1),
                      "input_scale": (None, None)},
}


class QuantizedShardReader:
    """`read_plain` and `read_layer` for `quantized_safetensors_weights`: this rank's part of each tensor."""

    def __init__(self, plan: ShardPlan, spec: QuantSpec, dtype: torch.dtype):
        self.plan, self.spec, self.dtype = plan, spec, dtype

    def read_plain(self, name: str, tensor_slice) -> torch.Tensor:
        return read_shard(tensor_slice, self.plan.shard_of(name), self.dtype)

    def read_layer(self, prefix: str, slices: dict[str, object]) -> dict[str, torch.Tensor]:
        shard = self.plan.shard_of(f"{prefix}.weight")
        if shard is None:
            return {suffix: tensor_slice[:] for suffix, tensor_slice in slices.items()}
        n, k = self._logical_shape(prefix, slices)
        logical_size = n if shard.dim == 0 else k
        parts = {}
        for suffix, tensor_slice in slices.items():
            axis = _AXES[self.spec.method][suffix][shard.dim]
            shape = list(tensor_slice.get_shape())
            if axis is None or axis >= len(shape) or shape[axis] == 1:
                parts[suffix] = tensor_slice[:]  # per tensor, or per channel along the other axis
                continue
            name = f"{prefix}.{suffix}"
            factor = self._factor(name, suffix, shard.dim, logical_size, shape[axis])
            stored = _stored_shard(name, shard, axis, factor, logical_size)
            parts[suffix] = read_shard(tensor_slice, stored, None)
        if "weight_shape" in parts:  # compressed-tensors: the rank's [N, K]
            n, k = (_shard_size(shard, n), k) if shard.dim == 0 else (n, _shard_size(shard, k))
            parts["weight_shape"] = torch.tensor([n, k], dtype=parts["weight_shape"].dtype)
        if "g_idx" in parts and shard.dim == 1:
            parts["g_idx"] = self._local_groups(prefix, parts["g_idx"], shard)
        return parts

    def _logical_shape(self, prefix: str, slices: dict[str, object]) -> tuple[int, int]:
        """The layer's [N, K] from its marker tensor."""
        method = self.spec.method
        if method == QuantMethod.GPTQ:
            words, n = slices["qweight"].get_shape()
            return n, words * 8
        if method == QuantMethod.AWQ:
            k, words = slices["qweight"].get_shape()
            return words * 8, k
        if method == QuantMethod.PACKED_INT:
            n, words = slices["weight_packed"].get_shape()
            return n, words * (32 // self.spec.bits)
        return tuple(slices["weight"].get_shape())

    def _factor(self, name: str, suffix: str, dim: int, logical_size: int, stored_size: int) -> int:
        """Logical rows or columns per stored one along the split axis (a word's values, a group, a block)."""
        if self.spec.method == QuantMethod.FP8 and suffix == "weight_scale_inv" and self.spec.fp8_block is not None:
            return self.spec.fp8_block[dim]
        if logical_size % stored_size:
            raise UnsupportedModelError(f"{name}: {stored_size} stored rows or columns for {logical_size} do not "
                                        f"split evenly for tensor parallelism")
        return logical_size // stored_size

    def _local_groups(self, prefix: str, g_idx: torch.Tensor, shard: TensorShard) -> torch.Tensor:
        """A row-parallel rank's g_idx as its own groups, numbered from 0. Act-order (desc_act) checkpoints
        put any input row in any group, so a rank's rows need groups a split by rows does not give it."""
        group = self.spec.group_size
        if group is None:  # one group a channel: every row's is 0
            return g_idx
        local = g_idx.long() - shard.ranges[0][0] // group
        if not torch.equal(local, torch.arange(local.numel()) // group):
            raise UnsupportedModelError(f"{prefix}.g_idx: a desc_act (act-order) GPTQ checkpoint cannot be split "
                                        f"over tensor-parallel ranks yet; use a desc_act false checkpoint")
        return local.to(g_idx.dtype)


def _stored_shard(name: str, shard: TensorShard, axis: int, factor: int, logical_size: int) -> TensorShard:
    """`shard`'s ranges along a stored tensor's `axis` that holds `factor` logical rows a stored one."""
    ranges = []
    for start, stop in shard.ranges:
        if start % factor or (stop % factor and stop != logical_size):
            raise UnsupportedModelError(f"{name}: the tensor-parallel split at {start}..{stop} falls inside a "
                                        f"packed unit of {factor} (try another --tensor-parallel-size)")
        ranges.append((start // factor, -(-stop // factor)))
    return TensorShard(axis, tuple(ranges))


def _shard_size(shard: TensorShard, full: int) -> int:
    return sum(stop - start for start, stop in shard.ranges) if shard.ranges else full
