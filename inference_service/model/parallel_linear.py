"""Tensor-parallel variants of the projections, the embedding and the lm_head.

Each wraps the Linear (or `Embedding`) a rank built for its shard (`distributed/sharding.py`: the
rank's decoder is built from its local config, so the wrapped module already has the shard's shape
and was loaded with the shard's slices) and adds the communication Megatron's split needs:

    ColumnParallelLinear   qkv_proj, gate_up_proj: none (input replicated, output stays split)
    RowParallelLinear      o_proj, down_proj: one all-reduce of the partial sums
    VocabParallelEmbedding rows outside the rank's vocabulary range are zeroed, then all-reduced
    ParallelLMHead         the ranks' logits columns gathered on rank 0, padding dropped

`parallelize(model, group, plan)` swaps them into a loaded `DecoderModel`; both stacks read the
projections through the module attributes, so neither changes.
"""

from __future__ import annotations

import torch
from torch import nn

from inference_service.distributed.group import TensorParallelGroup
from inference_service.distributed.sharding import ShardPlan
from inference_service.model.layers import Embedding
from inference_service.model.linear import LinearBase


class _ShardedLinear(LinearBase):
    """A Linear whose weight is a shard held by `local` (a module of the model too, which is why
    `num_weight_bytes` is 0 here: the bytes are counted once, on `local`)."""

    def __init__(self, local: LinearBase, group: TensorParallelGroup):
        nn.Module.__init__(self)
        self.local, self.group = local, group
        self.in_features, self.out_features = local.in_features, local.out_features
        self.output_partitions = local.output_partitions
        self.bias = None  # the local Linear adds its own (rank 0's only, for row-parallel ones)

    def load_rows(self, first_row, weight) -> None:
        self.local.load_rows(first_row, weight)

    def load_bias_rows(self, first_row: int, bias: torch.Tensor) -> None:
        self.local.load_bias_rows(first_row, bias)

    def num_weight_bytes(self) -> int:
        return 0


class ColumnParallelLinear(_ShardedLinear):
    """x [N, in] replicated -> this rank's output rows [N, out / world_size]; no communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(x)


class RowParallelLinear(_ShardedLinear):
    """x [N, in / world_size] (this rank's columns) -> the full output [N, out], summed over ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.local(x))


class VocabParallelEmbedding(nn.Module):
    """The embedding of the rows [vocab_start, vocab_stop) on this rank; `lookup` returns every
    token's row, whichever rank holds it."""

    def __init__(self, local: Embedding, group: TensorParallelGroup, vocab_start: int, vocab_stop: int):
        super().__init__()
        self.local, self.group = local, group
        self.vocab_start, self.num_real_rows = vocab_start, vocab_stop - vocab_start
        self.scale = local.scale

    @property
    def weight(self) -> nn.Parameter:
        return self.local.weight

    @property
    def quantized(self):
        return self.local.quantized

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 (global ids) -> [T, H], a fresh buffer."""
        local_ids = input_ids - self.vocab_start
        is_elsewhere = (local_ids < 0) | (local_ids >= self.num_real_rows)  # [T]
        hidden = self.local.lookup(local_ids.masked_fill(is_elsewhere, 0))
        hidden.masked_fill_(is_elsewhere[:, None], 0)
        return self.group.all_reduce(hidden)


class ParallelLMHead(_ShardedLinear):
    """hidden [N, H] -> logits [N, vocab] on rank 0 (the ranks' column blocks gathered, the last
    one's padding dropped); other ranks get their own block [N, vocab / world_size]."""

    def __init__(self, local: LinearBase, group: TensorParallelGroup, vocab_size: int):
        super().__init__(local, group)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.group.gather_last_dim(self.local(x))
        return logits[:, :self.vocab_size] if self.group.is_driver else logits


def parallelize(model: nn.Module, group: TensorParallelGroup, plan: ShardPlan) -> None:
    """Wrap a loaded rank-local `DecoderModel`'s modules in the variants above, in place."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, group)
        attn.o_proj = RowParallelLinear(attn.o_proj, group)
        mlp.gate_up_proj = ColumnParallelLinear(mlp.gate_up_proj, group)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, group, *plan.vocab_range)
    model.lm_head = ParallelLMHead(model.lm_head, group, plan.config.vocab_size)
    # NOTE: the eager stack's C++ decode layers add o_proj and down_proj into the residual stream inside
    # their kernels, before any all-reduce could sum the ranks' parts: they do not run on shards. (The
    # fused stack's folded path does: it lets rank 0 alone add the stream, then all-reduces.)
    if hasattr(model.stack, "cpu_decode_layers"):
        model.stack.cpu_decode_layers = None
