"""The KV cache's head-major layout (`kv_cache.new_kv_cache`): every kernel that reads or writes the cache gives
bit for bit what it gives on the token-major layout, the engine picks the layout by attention backend, and a
tensor-parallel worker allocates its twin in rank 0's layout."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE, PagedKV, poisoned

from inference_service.config import CacheConfig
from inference_service.distributed.step_broadcast import StepHeader
from inference_service.engine.kv_cache import KVCacheSpec, allocate_kv_caches, is_head_major, new_kv_cache
from inference_service.model.config import ModelConfig
from kernels import FP8_DTYPE, paged_decode_attention, paged_prefill_attention, write_kv_cache
from kernels.decode_prologue import DecodeAppend

BF16 = torch.bfloat16


def head_major_copy(cache: torch.Tensor) -> torch.Tensor:
    """The same values, stored [num_blocks, Hkv, block_size, D]."""
    copy = new_kv_cache(tuple(cache.shape), cache.dtype, cache.device, head_major=True)
    copy.copy_(cache)
    return copy


def test_new_kv_cache_lays_each_heads_page_out_contiguously():
    cache = new_kv_cache((3, 16, 4, 8), torch.float32, DEVICE, head_major=True)
    assert tuple(cache.shape) == (3, 16, 4, 8) and cache.stride() == (16 * 4 * 8, 8, 16 * 8, 1)
    assert is_head_major(cache) and not is_head_major(new_kv_cache((3, 16, 4, 8), torch.float32, DEVICE, False))
    cache[1, :, 2] = 7.0  # block 1, head 2: one run of 16 x 8 in memory
    flat = cache.transpose(1, 2).contiguous().view(-1)
    start = (1 * 4 + 2) * 16 * 8
    assert torch.equal(flat.nonzero().flatten(), torch.arange(start, start + 16 * 8, device=DEVICE))


@pytest.mark.parametrize("cache_dtype", [None, FP8_DTYPE], ids=["bf16_cache", "fp8_cache"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_reads_head_major_as_token_major(cache_dtype, splits):
    torch.manual_seed(0)
    kv = PagedKV([1, 15, 16, 17, 40], 16, 2, 64, BF16, cache_dtype=cache_dtype)
    q = torch.randn(5, 6, 64, device=DEVICE).to(BF16)
    outs = []
    for k_cache, v_cache in ((kv.k_cache, kv.v_cache), (head_major_copy(kv.k_cache), head_major_copy(kv.v_cache))):
        outs.append(paged_decode_attention(q, k_cache, v_cache, kv.block_tables, kv.seq_lens, 0.125,
                                           out=poisoned(q.shape, BF16), num_kv_splits=splits, k_scale=0.5,
                                           v_scale=0.25))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("cache_dtype", [None, FP8_DTYPE], ids=["bf16_cache", "fp8_cache"])
def test_decode_append_and_kv_write_store_the_same_values_head_major(cache_dtype):
    torch.manual_seed(1)
    lens = [3, 17, 33]
    kv = PagedKV([n - 1 for n in lens], 16, 2, 64, BF16, cache_dtype=cache_dtype, spare_blocks=4)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    block_tables = kv.block_tables.clone()
    free = sorted(set(range(1, kv.k_cache.shape[0])) - set(block_tables.flatten().tolist()))
    block_tables[1, 1], block_tables[2, 2] = free[0], free[1]  # tokens 17 and 33 open fresh blocks
    slots = torch.tensor([int(block_tables[0, 0]) * 16 + 2, free[0] * 16, free[1] * 16], device=DEVICE)
    k, v = (torch.randn(3, 2, 64, device=DEVICE).to(BF16) for _ in range(2))
    q = torch.randn(3, 4, 64, device=DEVICE).to(BF16)
    results = []
    for head_major in (False, True):
        caches = [(head_major_copy(c) if head_major else c.clone()) for c in (kv.k_cache, kv.v_cache)]
        out = paged_decode_attention(q, *caches, block_tables, seq_lens, 0.125, out=poisoned(q.shape, BF16),
                                     append=DecodeAppend(k, v, slots, None))
        written = [(head_major_copy(c) if head_major else c.clone()) for c in (kv.k_cache, kv.v_cache)]
        write_kv_cache(k, v, *written, slots)
        results.append((out, caches, written))
    (out_t, caches_t, written_t), (out_h, caches_h, written_h) = results
    assert torch.equal(out_t, out_h)
    for a, b, c in zip(caches_t, caches_h, written_h, strict=True):
        assert is_head_major(b) and is_head_major(c)
        assert torch.equal(a.float().nan_to_num(), b.float().nan_to_num())  # NaN: slots nobody owns
        assert torch.equal(b.float().nan_to_num(), c.float().nan_to_num())
    for a, b in zip(written_t, written_h, strict=True):
        assert torch.equal(a.float().nan_to_num(), b.float().nan_to_num())


def test_prefill_attention_reads_head_major_as_token_major():
    torch.manual_seed(2)
    seqs = [(1, 1), (15, 15), (3, 37), (20, 20)]  # (query_len, seq_len): fresh prompts and an extend
    kv = PagedKV([s for _, s in seqs], 16, 2, 64, BF16)
    q = torch.randn(sum(n for n, _ in seqs), 6, 64, device=DEVICE).to(BF16)
    qsl = torch.tensor([0, 1, 16, 19, 39], dtype=torch.int32, device=DEVICE)
    outs = [paged_prefill_attention(q, k_cache, v_cache, kv.block_tables, qsl, kv.seq_lens, 20, 0.125,
                                    out=poisoned(q.shape, BF16))
            for k_cache, v_cache in ((kv.k_cache, kv.v_cache),
                                     (head_major_copy(kv.k_cache), head_major_copy(kv.v_cache)))]
    assert torch.equal(outs[0], outs[1])


def spec_for(layout: str, backend: str) -> KVCacheSpec:
    model_config = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=64, hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8)
    return KVCacheSpec.build(model_config, CacheConfig(kv_cache_layout=layout), torch.float32, backend)


def test_the_layout_follows_the_attention_backend_unless_set():
    assert spec_for("auto", "triton").head_major and not spec_for("auto", "torch").head_major
    assert not spec_for("nhd", "triton").head_major and spec_for("hnd", "triton").head_major
    with pytest.raises(ValueError, match="--kv-cache-layout hnd needs the Triton attention backend"):
        spec_for("hnd", "torch")
    with pytest.raises(ValueError, match="--kv-cache-layout must be auto, nhd or hnd, got 'xyz'"):
        CacheConfig(kv_cache_layout="xyz")


def test_host_arena_caches_are_head_major_views_of_one_buffer():
    spec = spec_for("hnd", "triton")
    num_blocks, caches = allocate_kv_caches(spec, CacheConfig(kv_cache_memory_mib=1), torch.device("cpu"))
    k0, v0 = caches[0]
    assert tuple(k0.shape) == spec.block_shape(num_blocks) and is_head_major(k0) and is_head_major(v0)
    # the caches share the arena: layer 0's V right after its K
    assert v0.data_ptr() - k0.data_ptr() == k0.numel() * k0.element_size()


def test_step_header_carries_the_layout_to_the_workers():
    header = StepHeader(1, 3, 3, 2, 123, 10, 16, 1, 40, 0, kv_head_major=1)
    assert StepHeader.unpack(header.pack()) == header
