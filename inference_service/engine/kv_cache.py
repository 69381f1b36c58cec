"""The paged KV cache: its element type, its size from the memory budget, and its allocation.

On a GPU with no fixed `--kv-cache-memory`, the cache takes `--gpu-memory-fraction` of the memory
free once the weights are loaded, less what the steps themselves need: the activation peak of the
largest prefill step and of the largest captured decode graph, measured by running both once over a
one-block stand-in cache before the real cache exists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.config import CacheConfig
from inference_service.engine.host_memory import huge_page_zeros
from inference_service.model.config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MIB = 1024
FP8_KV_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's k_cache and v_cache are each [num_blocks, block_size, num_kv_heads, head_dim]; with
    `head_major` that shape is a view of memory laid out [num_blocks, num_kv_heads, block_size, head_dim]
    (`new_kv_cache`)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    head_major: bool = False

    @classmethod
    def build(cls, model_config: ModelConfig, cache_config: CacheConfig, model_dtype: torch.dtype,
              attention_backend: str) -> KVCacheSpec:
        dtype = model_dtype
        if cache_config.kv_cache_dtype == "fp8":
            if attention_backend != "triton":
                raise ValueError("--kv-cache-dtype fp8 needs the Triton attention backend (a CUDA device, "
                                 f"or --attention-backend triton); this engine uses {attention_backend!r}")
            dtype = FP8_KV_DTYPE
        elif cache_config.kv_cache_dtype == "fp16":
            if attention_backend == "triton":
                raise ValueError("--kv-cache-dtype fp16 is for the CPU attention backend; this engine uses the "
                                 "Triton one (where --kv-cache-dtype fp8 halves a 16-bit cache)")
            dtype = torch.float16
        layout = cache_config.kv_cache_layout
        if layout == "hnd" and attention_backend != "triton":
            raise ValueError("--kv-cache-layout hnd needs the Triton attention backend (a CUDA device, or "
                             f"--attention-backend triton); this engine uses {attention_backend!r}, whose kernels "
                             "read the cache token-major")
        head_major = layout == "hnd" or (layout == "auto" and attention_backend == "triton")
        return cls(model_config.num_hidden_layers, cache_config.block_size, model_config.num_key_value_heads,
                   model_config.head_dim, dtype, head_major)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def new_cache(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """One zeroed k or v cache of `num_blocks` blocks in this spec's layout."""
        return new_kv_cache(self.block_shape(num_blocks), self.dtype, device, self.head_major)


def new_kv_cache(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device | str,
                 head_major: bool, memory: torch.Tensor | None = None) -> torch.Tensor:
    """A zeroed cache of `shape` [num_blocks, block_size, Hkv, D] (or a view of `memory`, zeroed, of as many
    elements): token-major as the shape says, or head-major, where each head's tokens of a block are one
    contiguous run (block_size x D: 2 KB for fp8 pages of 16 x 128) instead of block_size runs of D, 128 B apart
    by Hkv x D. The attention kernels take strides, so either layout reads through the same shape."""
    num_blocks, block_size, num_kv_heads, head_dim = shape
    stored = (num_blocks, num_kv_heads, block_size, head_dim) if head_major else shape
    cache = torch.zeros(stored, dtype=dtype, device=device) if memory is None else memory.view(stored)
    return cache.transpose(1, 2) if head_major else cache


def is_head_major(cache: torch.Tensor) -> bool:
    """Whether a [num_blocks, block_size, Hkv, D] cache is laid out head-major (`new_kv_cache`)."""
    return cache.shape[2] > 1 and cache.stride(2) > cache.stride(1)


def allocate_kv_caches(spec: KVCacheSpec, cache_config: CacheConfig, device: torch.device, reserve_bytes: int = 0
                       ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(num_blocks, [(k_cache, v_cache)] per layer), zero-filled, sized from the config's budget;
    `reserve_bytes` is kept free on a GPU for activations and graphs."""
    if cache_config.kv_cache_memory_mib is not None:
        budget = cache_config.kv_cache_memory_mib * 2**20
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if cache_config.gpu_memory_utilization is not None:
            # vLLM's --gpu-memory-utilization: a share of the total, of which what is in use already
            # (the weights just loaded, other processes) is spent.
            budget = int(total * cache_config.gpu_memory_utilization) - (total - free) - reserve_bytes
        else:
            budget = int(free * cache_config.gpu_memory_fraction) - reserve_bytes
    else:
        budget = DEFAULT_CPU_KV_CACHE_MIB * 2**20
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget / 2**20:.1f} MiB holds no block of {spec.bytes_per_block} "
                         f"bytes (reserved for activations: {reserve_bytes / 2**20:.0f} MiB)")
    shape = spec.block_shape(num_blocks)
    if device.type == "cpu":
        # One buffer on huge pages for every layer's cache (host_memory.py says why).
        arena = huge_page_zeros(num_blocks * spec.bytes_per_block).view(spec.dtype).view(2 * spec.num_layers, -1)
        caches = [(new_kv_cache(shape, spec.dtype, device, spec.head_major, arena[2 * i]),
                   new_kv_cache(shape, spec.dtype, device, spec.head_major, arena[2 * i + 1]))
                  for i in range(spec.num_layers)]
    else:
        caches = [(spec.new_cache(num_blocks, device), spec.new_cache(num_blocks, device))
                  for _ in range(spec.num_layers)]
    logger.info("KV cache: %d blocks x %d tokens (%d tokens, %.0f MiB, %s, %s on %s; %.0f MiB kept for activations)",
                num_blocks, spec.block_size, num_blocks * spec.block_size, num_blocks * spec.bytes_per_block / 2**20,
                spec.dtype, "head-major" if spec.head_major else "token-major", device, reserve_bytes / 2**20)
    return int(num_blocks), caches


@torch.inference_mode()
def profile_activation_bytes(model: torch.nn.Module, spec: KVCacheSpec, max_num_tokens: int, max_graph_batch: int,
                             max_model_len: int, device: torch.device, max_prefill_graph_tokens: int = 0) -> int:
    """Peak bytes a prefill step of `max_num_tokens` tokens needs, plus those a decode step of
    `max_graph_batch` rows keeps in the graph pool, plus the graphs' shared logits buffer, plus those a
    prefill of `max_prefill_graph_tokens` keeps in the prefill graphs' pool.

    Runs on a one-block cache: every block-table entry is block 0 and no slot is written (-1), so
    the attention reads garbage but finite keys, which is all a memory profile needs."""
    one_block = spec.new_cache(1, device)
    caches = [(one_block, one_block)] * spec.num_layers
    seq_len = min(max_num_tokens, max_model_len)
    num_seqs = -(-max_num_tokens // seq_len)
    query_lens = [seq_len] * (num_seqs - 1) + [max_num_tokens - seq_len * (num_seqs - 1)]

    def peak_of(lens: list[int]) -> int:
        """Fresh sequences of `lens` tokens each (a decode step: one token each)."""
        num_tokens = sum(lens)
        width = -(-max(lens) // spec.block_size)
        metadata = AttentionMetadata.for_sequences([0] * len(lens), lens, [[0] * width] * len(lens), spec.block_size,
                                                   device, write_kv=False)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        hidden = model(input_ids, positions, caches, metadata)
        last_rows = torch.tensor(metadata.query_start_loc_cpu[1:], device=device) - 1
        model.compute_logits(hidden[last_rows])
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base

    prefill = peak_of(query_lens)
    # NOTE: a long fresh prompt attends through SDPA (attention/dense_prefill.py), a short one through the paged
    # prefill kernel: this step compiles that kernel now rather than on the first short prompt (seconds).
    peak_of([min(spec.block_size, max_num_tokens)])
    decode = peak_of([1] * max_graph_batch) if max_graph_batch else 0
    prefill_graphs = peak_of([max_prefill_graph_tokens]) if max_prefill_graph_tokens else 0
    logits = max_graph_batch * model.config.vocab_size * 4
    del one_block, caches
    torch.cuda.empty_cache()
    logger.info("activation peaks: prefill of %d tokens %.0f MiB, decode of %d rows %.0f MiB, prefill graphs to "
                "%d tokens %.0f MiB", max_num_tokens, prefill / 2**20, max_graph_batch, decode / 2**20,
                max_prefill_graph_tokens, prefill_graphs / 2**20)
    return prefill + decode + prefill_graphs + logits
