"""Turns a scheduled step into tensors, runs the model over the paged KV cache and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.config import CacheConfig
from inference_service.engine.sampler import Sampler, SamplingBatch
from inference_service.engine.scheduler import ScheduledSeq
from inference_service.model.loader import LoadedModel

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MIB = 1024


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


def kv_cache_bytes_per_block(loaded: LoadedModel, block_size: int, dtype: torch.dtype) -> int:
    cfg = loaded.config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    """Owns the KV cache and runs steps. One instance per engine; not thread-safe."""

    def __init__(self, loaded: LoadedModel, cache_config: CacheConfig, device: torch.device, dtype: torch.dtype):
        self.model = loaded.model
        self.model_config = loaded.config
        self.device = device
        self.dtype = dtype
        self.block_size = cache_config.block_size
        self.num_blocks = self._num_blocks(loaded, cache_config)
        cfg = self.model_config
        shape = (self.num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler()
        logger.info(
            "KV cache: %d blocks x %d tokens (%d tokens, %.0f MiB, %s on %s)",
            self.num_blocks, self.block_size, self.num_blocks * self.block_size,
            self.num_blocks * kv_cache_bytes_per_block(loaded, self.block_size, dtype) / 2**20, dtype, device,
        )

    def _num_blocks(self, loaded: LoadedModel, cache_config: CacheConfig) -> int:
        per_block = kv_cache_bytes_per_block(loaded, self.block_size, self.dtype)
        if cache_config.kv_cache_memory_mib is not None:
            budget = cache_config.kv_cache_memory_mib * 2**20
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cache_config.gpu_memory_fraction)
        else:
            budget = DEFAULT_CPU_KV_CACHE_MIB * 2**20
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget / 2**20:.1f} MiB holds no block of {per_block} bytes")
        return int(num_blocks)

    def _prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        num_seqs = len(scheduled)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slot_mapping = np.empty(num_tokens, dtype=np.int64)
        seq_lens = np.empty(num_seqs, dtype=np.int64)
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, s in enumerate(scheduled):
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            lo, hi = query_start_loc[i], query_start_loc[i + 1]
            block_table = seq.block_table
            block_tables[i, : len(block_table)] = block_table
            seq_lens[i] = end
            if s.num_new_tokens == 1:  # decode: skip the numpy temporaries
                input_ids[lo] = seq.token_ids[start]
                positions[lo] = start
                slot_mapping[lo] = block_table[start // bs] * bs + start % bs
                continue
            input_ids[lo:hi] = seq.token_ids[start:end]
            pos = np.arange(start, end)
            positions[lo:hi] = pos
            slot_mapping[lo:hi] = block_tables[i, pos // bs] * bs + pos % bs
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), metadata

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq]) -> dict[int, SampledToken]:
        """Computes one step; returns the sampled token of every sequence that samples, by seq_id."""
        input_ids, positions, metadata = self._prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)  # [T, hidden]
        rows = [i for i, s in enumerate(scheduled) if s.is_sampling]
        if not rows:
            return {}
        last_token_rows = torch.tensor([metadata.query_start_loc_cpu[i + 1] - 1 for i in rows], device=self.device)
        logits = self.model.compute_logits(hidden[last_token_rows])  # [num_sampling, vocab]
        seqs = [scheduled[i].seq for i in rows]
        histories = [_token_history(seq) for seq in seqs]
        batch = SamplingBatch.build(
            params=[seq.params for seq in seqs],
            prompt_token_ids=[h[0] for h in histories],
            output_token_ids=[h[1] for h in histories],
            generators=[seq.generator for seq in seqs],
            device=self.device,
            eos_token_ids=[seq.eos_token_ids for seq in seqs],
        )
        out = self.sampler(logits, batch)
        return {
            seq.seq_id: SampledToken(out.token_ids[j], out.logprobs[j], out.top_logprobs[j])
            for j, seq in enumerate(seqs)
        }


def _token_history(seq) -> tuple[list[int], list[int]]:
    """(prompt, output) token ids as far as the sequence's sampling reads them.

    NOTE: slicing a long prompt every step for every row is the hot path's largest Python cost, and
    only penalties and min_tokens look at the history; other rows get empty lists."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        return seq.prompt_token_ids, seq.output_token_ids
    if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.min_tokens > 0:
        return [], seq.output_token_ids
    return [], []
