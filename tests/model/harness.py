"""A tiny paged-KV driver for the model API: what the engine's model runner does, minus scheduling.

Blocks are handed out in a shuffled order so a sequence's blocks are never contiguous, which proves
the model reads its context through the block table."""

from __future__ import annotations

import random

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.model.decoder import DecoderModel


def build_metadata(seq_lens_before: list[int], query_lens: list[int], block_tables: list[list[int]],
                   block_size: int) -> AttentionMetadata:
    """Metadata for one step: sequence i adds query_lens[i] tokens after seq_lens_before[i] cached ones."""
    return AttentionMetadata.for_sequences(seq_lens_before, query_lens, block_tables, block_size)


class PagedHarness:
    """Greedy generation for a batch of prompts through `DecoderModel.forward` on a paged cache."""

    def __init__(self, model: DecoderModel, num_blocks: int = 256, block_size: int = 16, seed: int = 0,
                 cache_dtype: torch.dtype | None = None):
        self.model, self.block_size = model, block_size
        shape = model.kv_cache_shape(num_blocks, block_size)
        dtype = cache_dtype or model.dtype
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(model.config.num_hidden_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)

    def _ensure_blocks(self, table: list[int], num_tokens: int) -> None:
        while len(table) * self.block_size < num_tokens:
            table.append(self.free_blocks.pop())

    def all_logits(self, piece: list[int], num_cached: int, table: list[int]) -> torch.Tensor:
        """One sequence's step of `piece` after `num_cached` tokens: logits [len(piece), vocab] of every row."""
        self._ensure_blocks(table, num_cached + len(piece))
        metadata = build_metadata([num_cached], [len(piece)], [table], self.block_size)
        positions = torch.arange(num_cached, num_cached + len(piece))
        hidden = self.model(torch.tensor(piece), positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden)

    def step(self, tokens: list[list[int]], cached: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Run one step; returns logits [num_seqs, vocab] of each sequence's last new token."""
        for table, before, new in zip(tables, cached, tokens):
            self._ensure_blocks(table, before + len(new))
        metadata = build_metadata(cached, [len(t) for t in tokens], tables, self.block_size)
        input_ids = torch.tensor([tok for seq in tokens for tok in seq], dtype=torch.int64)
        positions = torch.tensor([p for before, seq in zip(cached, tokens)
                                  for p in range(before, before + len(seq))], dtype=torch.int64)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        last_rows = torch.tensor(metadata.query_start_loc_cpu[1:], dtype=torch.int64) - 1
        return self.model.compute_logits(hidden.index_select(0, last_rows))

    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 prefill_chunk: int | None = None) -> list[list[int]]:
        """Greedy tokens for each prompt; prompts are prefilled together (in chunks if asked)."""
        tables: list[list[int]] = [[] for _ in prompts]
        cached = [0] * len(prompts)
        chunk = prefill_chunk or max(len(p) for p in prompts)
        logits = None
        pending = [list(p) for p in prompts]
        last_logits: list[torch.Tensor | None] = [None] * len(prompts)
        while any(pending):
            active = [i for i, p in enumerate(pending) if p]
            pieces = [pending[i][:chunk] for i in active]
            logits = self.step(pieces, [cached[i] for i in active], [tables[i] for i in active])
            for row, i in enumerate(active):
                cached[i] += len(pieces[row])
                pending[i] = pending[i][len(pieces[row]):]
                last_logits[i] = logits[row]
        outputs = [[int(l.argmax())] for l in last_logits]
        for _ in range(max_new_tokens - 1):
            logits = self.step([[out[-1]] for out in outputs], cached, tables)
            for i, out in enumerate(outputs):
                cached[i] += 1
                out.append(int(logits[i].argmax()))
        return outputs
