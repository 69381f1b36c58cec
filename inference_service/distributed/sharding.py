"""Which part of each checkpoint tensor a tensor-parallel rank owns, and the config it builds.

Megatron's split of a decoder layer over N ranks (rank r of N):

    qkv_proj, gate_up_proj   column-parallel: rank r keeps its heads' q, k, v rows, its share of the
                             gate and up rows; no communication
    o_proj, down_proj        row-parallel: rank r keeps the matching columns; the partial outputs are
                             summed by one all-reduce each
    embed_tokens, lm_head    vocab-parallel: rank r keeps ceil(V / N) rows (the last rank's padded with
                             zeros); lookups are masked and all-reduced, logits gathered on rank 0
    norms                    replicated

KV heads are split like q heads when there are at least N; with fewer, each is replicated on the
N / num_kv_heads ranks whose q heads read it. A rank builds the ordinary decoder from
`local_config()` (its own head, intermediate and vocab counts), so every shape it allocates is its
shard's, and the reader hands it only its slices (`TensorShard`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorShard:
    """A rank's part of one checkpoint tensor: `ranges` [start, stop) along `dim`, concatenated in
    order; then padded with zero rows to `pad_rows` rows; `is_zero`: the rank holds zeros of the
    tensor's shape instead (a row-parallel bias is added once, by rank 0)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    pad_rows: int | None = None
    is_zero: bool = False


@dataclass(frozen=True)
class ShardPlan:
    """The split of `config`'s model over `world_size` ranks, seen from `rank`."""

    config: ModelConfig
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        c, n = self.config, self.world_size
        if n < 1 or not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} of a tensor-parallel size {n}")
        if c.num_attention_heads % n:
            raise UnsupportedModelError(f"--tensor-parallel-size {n} does not divide the model's "
                                        f"{c.num_attention_heads} attention heads")
        kv = c.num_key_value_heads
        if kv % n and n % kv:
            raise UnsupportedModelError(f"--tensor-parallel-size {n} neither divides nor is a multiple of the "
                                        f"model's {kv} KV heads")
        if c.intermediate_size % n:
            raise UnsupportedModelError(f"--tensor-parallel-size {n} does not divide the model's MLP size "
                                        f"{c.intermediate_size}")

    @property
    def num_local_heads(self) -> int:
        return self.config.num_attention_heads // self.world_size

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.config.num_key_value_heads // self.world_size)

    @property
    def num_local_vocab(self) -> int:
        """Rows of the embedding and lm_head a rank keeps: ceil(V / N)."""
        return -(-self.config.vocab_size // self.world_size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, stop) of the real vocabulary rows this rank keeps (stop - start may be short of
        `num_local_vocab` on the last rank)."""
        start = self.rank * self.num_local_vocab
        return min(start, self.config.vocab_size), min(start + self.num_local_vocab, self.config.vocab_size)

    def local_config(self) -> ModelConfig:
        """The config a rank builds its decoder from: its heads, MLP rows and vocabulary rows."""
        return replace(self.config, num_attention_heads=self.num_local_heads,
                       num_key_value_heads=self.num_local_kv_heads,
                       intermediate_size=self.config.intermediate_size // self.world_size,
                       vocab_size=self.num_local_vocab)

    def _q_rows(self) -> tuple[int, int]:
        rows = self.num_local_heads * self.config.head_dim
        return self.rank * rows, (self.rank + 1) * rows

    def _kv_rows(self) -> tuple[int, int]:
        c, d = self.config, self.config.head_dim
        if c.num_key_value_heads >= self.world_size:
            rows = self.num_local_kv_heads * d
            return self.rank * rows, (self.rank + 1) * rows
        # Fewer KV heads than ranks: rank r's q heads read KV head r // (N / num_kv_heads).
        head = self.rank // (self.world_size // c.num_key_value_heads)
        return head * d, (head + 1) * d

    def _mlp_rows(self) -> tuple[int, int]:
        rows = self.config.intermediate_size // self.world_size
        return self.rank * rows, (self.rank + 1) * rows

    def shard_of(self, name: str) -> TensorShard | None:
        """This rank's part of the checkpoint tensor `name` (Hugging Face naming); None: all of it."""
        if self.world_size == 1:
            return None
        module, _, kind = name.rpartition(".")
        c = self.config
        q_size, kv_size, inter = c.q_size, c.kv_size, c.intermediate_size

        def offset(rows: tuple[int, int], by: int) -> tuple[int, int]:
            return rows[0] + by, rows[1] + by

        if module.endswith("self_attn.q_proj"):
            return TensorShard(0, (self._q_rows(),))
        if module.endswith(("self_attn.k_proj", "self_attn.v_proj")):
            return TensorShard(0, (self._kv_rows(),))
        if module.endswith("self_attn.qkv_proj"):  # stored fused (Phi-3)
            return TensorShard(0, (self._q_rows(), offset(self._kv_rows(), q_size),
                                   offset(self._kv_rows(), q_size + kv_size)))
        if module.endswith(("mlp.gate_proj", "mlp.up_proj")):
            return TensorShard(0, (self._mlp_rows(),))
        if module.endswith("mlp.gate_up_proj"):  # stored fused (Phi-3, GLM-4)
            return TensorShard(0, (self._mlp_rows(), offset(self._mlp_rows(), inter)))
        if module.endswith(("self_attn.o_proj", "mlp.down_proj")):
            if kind == "bias":
                return None if self.is_bias_owner else TensorShard(0, (), is_zero=True)
            return TensorShard(1, (self._q_rows() if "self_attn" in module else self._mlp_rows(),))
        if module.endswith(("embed_tokens", "lm_head")):
            return TensorShard(0, (self.vocab_range,), pad_rows=self.num_local_vocab)
        return None

    @property
    def is_bias_owner(self) -> bool:
        """Whether this rank adds the row-parallel projections' biases (rank 0 only: the all-reduce sums)."""
        return self.rank == 0
