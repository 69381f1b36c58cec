"""The embedding forward pass: token-id sequences in, one pooled vector each out.

Encoders (BERT) run packed; decoders run a fresh prefill into a private scratch KV cache, so the
paged cache of running generations is never touched."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.model.bert import PackedBatch
from inference_service.model.loader import LoadedModel
from inference_service.model.pooling import PoolingConfig, pool
from inference_service.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EmbeddingModelSpec:
    """What the embedding batcher needs of a model that runs elsewhere (in the engine core process)."""

    tokenizer: Tokenizer
    vocab_size: int
    embedding_dimensions: int
    pooling: PoolingConfig
    max_batch_tokens: int
    max_batch_size: int


class EmbeddingModel:
    """Pools a loaded model's hidden states; `embed_token_ids` is called on one thread at a time."""

    def __init__(self, loaded: LoadedModel, *, device: torch.device, dtype: torch.dtype, pooling: PoolingConfig,
                 max_batch_tokens: int, max_batch_size: int, block_size: int = 16):
        self.loaded, self.model = loaded, loaded.model
        self.device, self.dtype = device, dtype
        self.pooling = pooling
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        self._scratch_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # decoders only, made lazily

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    @property
    def embedding_dimensions(self) -> int:
        return self.loaded.config.hidden_size

    def spec(self) -> EmbeddingModelSpec:
        """This model's sizes and tokenizer, for a batcher in another process."""
        return EmbeddingModelSpec(self.tokenizer, self.vocab_size, self.embedding_dimensions, self.pooling,
                                  self.max_batch_tokens, self.max_batch_size)

    @torch.inference_mode()
    def embed_token_ids(self, seqs: list[list[int]]) -> torch.Tensor:
        """Pooled, not yet normalized embeddings of token-id sequences: [len(seqs), hidden] float32."""
        lens = [len(s) for s in seqs]
        input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=self.device)
        if self.loaded.is_encoder:
            batch = PackedBatch.build(lens, self.device)
            hidden = self.model(input_ids, batch)  # [T, H]
            return pool(hidden, batch.cu_seqlens, self.pooling.mode)
        positions, metadata = self._decoder_metadata(lens)
        hidden = self.model(input_ids, positions, self._scratch_cache(), metadata)  # [T, H]
        return pool(hidden, metadata.query_start_loc_cpu, self.pooling.mode)

    def _scratch_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The decoder's private KV cache: room for one full batch, each sequence in whole blocks."""
        if self._scratch_kv is None:
            num_blocks = -(-self.max_batch_tokens // self.block_size) + self.max_batch_size
            shape = self.model.kv_cache_shape(num_blocks, self.block_size)
            self._scratch_kv = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                                for _ in range(self.loaded.config.num_hidden_layers)]
        return self._scratch_kv

    def _decoder_metadata(self, lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """A fresh prefill of every sequence into consecutive scratch blocks (no cached prefix)."""
        bs, dev = self.block_size, self.device
        tables, first_block = [], 0
        for n in lens:  # each sequence's blocks consecutive, after the previous sequence's
            num_blocks = -(-n // bs)
            tables.append(list(range(first_block, first_block + num_blocks)))
            first_block += num_blocks
        metadata = AttentionMetadata.for_sequences([0] * len(lens), lens, tables, bs, dev)
        positions = torch.cat([torch.arange(n) for n in lens])
        return positions.to(dev), metadata
