"""The torch paged backend against a dense reference, over mixed prefill/decode batches, GQA and padding."""

from __future__ import annotations

import math
import random

import pytest
import torch

from harness import build_metadata
from inference_service.attention.backend import AttentionBackend, get_attention_backend
from inference_service.attention.torch_paged import TorchPagedAttention
from inference_service.cpu_kernels.quant import load_extension


def dense_attention(q, k, v, scale):
    """q [Tq, Hq, D] at the end of a context k, v [L, Hkv, D] -> [Tq, Hq, D], by explicit softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale  # [Hq, Tq, L]
    offset = k.shape[0] - q.shape[0]
    allowed = torch.arange(k.shape[0])[None, :] <= (torch.arange(q.shape[0])[:, None] + offset)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def run_case(num_heads, num_kv_heads, head_dim, block_size, cached_lens, query_lens, seed, pad_rows=0,
             use_cpu_kernels=True, cache_dtype=torch.float32):
    """One step of float32 queries over a cache of `cache_dtype`, against the dense reference over the keys and
    values as the cache holds them (a float16 cache rounds the step's new ones when it writes them; a whole fresh
    prompt attends over its own, unrounded)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, histories_k, histories_v = [], [], []
    for cached in cached_lens:
        # Each sequence's already-cached context: random keys/values written into its own blocks.
        total = cached + query_lens[len(tables)]
        table = [free.pop() for _ in range(math.ceil(total / block_size))]
        hk = torch.randn(cached, num_kv_heads, head_dim, generator=gen).to(cache_dtype).float()
        hv = torch.randn(cached, num_kv_heads, head_dim, generator=gen).to(cache_dtype).float()
        for pos in range(cached):
            k_cache[table[pos // block_size], pos % block_size] = hk[pos]
            v_cache[table[pos // block_size], pos % block_size] = hv[pos]
        tables.append(table)
        histories_k.append(hk)
        histories_v.append(hv)
    metadata = build_metadata(cached_lens, query_lens, tables, block_size)
    num_tokens = sum(query_lens)
    if pad_rows:
        # Trailing padding rows (slot -1) as a padded batch would have.
        metadata.slot_mapping = torch.cat([metadata.slot_mapping, torch.full((pad_rows,), -1)])
    total_rows = num_tokens + pad_rows
    q = torch.randn(total_rows, num_heads, head_dim, generator=gen)
    k = torch.randn(total_rows, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(total_rows, num_kv_heads, head_dim, generator=gen)
    untouched = k_cache.clone()
    scale = head_dim ** -0.5
    backend = TorchPagedAttention(use_cpu_kernels=use_cpu_kernels)
    out = backend.forward(q, k, v, k_cache, v_cache, metadata, scale)
    assert (backend._cpu_ops is not None) == (use_cpu_kernels and max(query_lens) == 1 and not pad_rows)
    assert out.shape == (total_rows, num_heads, head_dim)
    start = 0
    stored_k, stored_v = k.to(cache_dtype), v.to(cache_dtype)
    for i, (cached, query_len) in enumerate(zip(cached_lens, query_lens)):
        rows = slice(start, start + query_len)
        is_fresh_prompt = cached == 0 and query_len > 1
        ctx_k = torch.cat([histories_k[i], k[rows] if is_fresh_prompt else stored_k[rows].float()])
        ctx_v = torch.cat([histories_v[i], v[rows] if is_fresh_prompt else stored_v[rows].float()])
        expected = dense_attention(q[rows], ctx_k, ctx_v, scale)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        for j, pos in enumerate(range(cached, cached + query_len)):
            assert torch.equal(k_cache[tables[i][pos // block_size], pos % block_size], stored_k[start + j])
            assert torch.equal(v_cache[tables[i][pos // block_size], pos % block_size], stored_v[start + j])
        start += query_len
    # Nothing but the new tokens' slots changed (the -1 padding rows wrote nothing).
    changed = (k_cache != untouched).any(-1).any(-1).nonzero().tolist()
    written = {(tables[i][p // block_size], p % block_size) for i, c in enumerate(cached_lens)
               for p in range(c, c + query_lens[i])}
    assert {tuple(x) for x in changed} <= written


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(4, 4, 16, 4), (9, 3, 64, 16), (8, 1, 32, 5)])
def test_mixed_prefill_and_decode(num_heads, num_kv_heads, head_dim, block_size):
    # fresh prefill, chunked prefill over a cached prefix, decodes of different context lengths
    run_case(num_heads, num_kv_heads, head_dim, block_size,
             cached_lens=[0, 9, 17, 0, 3], query_lens=[7, 5, 1, 1, 1], seed=head_dim)


def test_prompt_rows_take_the_fused_cpu_attention():
    """Fresh prompts (causal) and prompts over a cached prefix (a mask) reach torch's fused CPU attention with a
    batch dimension, not the unbatched math fallback (3-5x slower: a 2k SmolLM2 prompt's layer 447 -> 92 ms)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_case(9, 3, 64, 16, cached_lens=[0, 40], query_lens=[64, 24], seed=5)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops


@pytest.fixture(params=["avx512", "avx2"])
def cpu_isa(request):
    """The C++ attention's SIMD paths: AVX-512 (head dims it has a kernel for) and the generic one."""
    ext = load_extension()
    if ext is None:
        pytest.skip("the CPU kernels did not build here")
    ext.limit_instruction_set(request.param)
    yield request.param
    ext.limit_instruction_set("amx")  # no cap: the best path this CPU has


@pytest.mark.parametrize("use_cpu_kernels", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("seed", range(3))
def test_decode_only_batches(seed, use_cpu_kernels, cpu_isa):
    """Decode-only steps: the C++ kernel (one call per layer) and the torch ops, each against the reference."""
    rng = random.Random(seed)
    cached = [rng.randint(0, 40) for _ in range(6)]
    run_case(6, 2, 16, 4, cached_lens=cached, query_lens=[1] * 6, seed=seed, use_cpu_kernels=use_cpu_kernels)
    run_case(9, 3, 64, 16, cached_lens=[rng.randint(0, 300) for _ in range(3)], query_lens=[1] * 3, seed=seed,
             use_cpu_kernels=use_cpu_kernels)


@pytest.mark.parametrize("head_dim", [32, 96, 128, 48])
def test_cpp_decode_head_dims_and_context_edges(head_dim, cpu_isa):
    """Every head dim the AVX-512 kernel has (48: none, the generic path), contexts of one token, of whole
    16-score registers and just past them."""
    run_case(8, 2, head_dim, 16, cached_lens=[0, 15, 31, 32, 47], query_lens=[1] * 5, seed=head_dim)


@pytest.mark.parametrize("use_cpu_kernels", [True, False], ids=["cpp", "torch"])
def test_float16_cache_under_float32_queries(use_cpu_kernels, cpu_isa):
    """`--kv-cache-dtype fp16`: keys and values rounded to float16 as written (bit for bit torch's cast), widened
    when read, by the C++ decode (both paths, head dims with and without an AVX-512 kernel) and the torch ops."""
    for head_dim in (64, 48):
        run_case(9, 3, head_dim, 16, cached_lens=[0, 15, 40, 200], query_lens=[1] * 4, seed=head_dim,
                 use_cpu_kernels=use_cpu_kernels, cache_dtype=torch.float16)
    run_case(4, 2, 32, 8, cached_lens=[0, 9, 17, 3], query_lens=[7, 5, 1, 1], seed=2, cache_dtype=torch.float16)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(10, 2, 64), (8, 1, 32), (12, 2, 128), (7, 1, 256)])
def test_cpp_decode_query_groups_over_several_value_passes(num_heads, num_kv_heads, head_dim, cpu_isa):
    """Groups of 5-8 query heads: the AVX-512 kernel weighs the values for up to 16 / (head_dim / 16) heads at a
    time (at most 4), so these take two to seven passes, the last one short."""
    run_case(num_heads, num_kv_heads, head_dim, 16, cached_lens=[0, 16, 40], query_lens=[1] * 3, seed=num_heads)


def test_cpp_decode_softmax_of_far_apart_scores(cpu_isa):
    """Scores hundreds apart: most weights underflow to zero, the largest dominate (the vector exp's range)."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(8, 16, 1, 64, generator=gen) * 4
    v_cache = torch.randn(8, 16, 1, 64, generator=gen)
    q, k, v = (torch.randn(1, h, 64, generator=gen) * 4 for h in (4, 1, 1))
    metadata = build_metadata([100], [1], [[5, 2, 7, 0, 3, 6, 1]], 16)
    context_k = torch.cat([k_cache[[5, 2, 7, 0, 3, 6, 1]].reshape(-1, 1, 64)[:100], k])
    context_v = torch.cat([v_cache[[5, 2, 7, 0, 3, 6, 1]].reshape(-1, 1, 64)[:100], v])
    out = TorchPagedAttention(use_cpu_kernels=True).forward(q, k, v, k_cache, v_cache, metadata, 1.0)
    # Scores near 300 carry float32 rounding of ~3e-5 into their exp: hence the tolerance, on either path.
    torch.testing.assert_close(out, dense_attention(q, context_k, context_v, 1.0), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("use_cpu_kernels", [True, False], ids=["cpp", "torch"])
def test_decode_only_equal_lengths_and_single_sequence(use_cpu_kernels):
    run_case(4, 2, 8, 4, cached_lens=[12, 12, 12], query_lens=[1, 1, 1], seed=5, use_cpu_kernels=use_cpu_kernels)
    run_case(4, 2, 8, 4, cached_lens=[0], query_lens=[1], seed=6, use_cpu_kernels=use_cpu_kernels)


def test_padding_rows_are_not_written():
    run_case(4, 2, 8, 4, cached_lens=[5, 0], query_lens=[1, 6], seed=8, pad_rows=3)
    run_case(4, 2, 8, 4, cached_lens=[5, 2], query_lens=[1, 1], seed=9, pad_rows=2)


def test_batched_equals_per_sequence():
    """One mixed batch gives the same rows as running each sequence alone."""
    cached, queries = [4, 0, 11, 6], [1, 6, 1, 3]
    gen = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 6, 3, 16
    caches = (torch.randn(40, block_size, kv_heads, dim, generator=gen),
              torch.randn(40, block_size, kv_heads, dim, generator=gen))
    tables = [[3, 17, 9, 25], [30, 2], [11, 5, 38, 20], [7, 33, 14]]
    q = torch.randn(sum(queries), heads, dim, generator=gen)
    k = torch.randn(sum(queries), kv_heads, dim, generator=gen)
    v = torch.randn(sum(queries), kv_heads, dim, generator=gen)
    batch_caches = (caches[0].clone(), caches[1].clone())
    batched = TorchPagedAttention().forward(q, k, v, *batch_caches, build_metadata(cached, queries, tables, block_size),
                                            0.25)
    start = 0
    for i in range(4):
        rows = slice(start, start + queries[i])
        alone_caches = (caches[0].clone(), caches[1].clone())
        alone = TorchPagedAttention().forward(q[rows], k[rows], v[rows], *alone_caches,
                                              build_metadata([cached[i]], [queries[i]], [tables[i]], block_size), 0.25)
        torch.testing.assert_close(batched[rows], alone, atol=1e-6, rtol=1e-6)
        start += queries[i]


def test_backend_protocol():
    backend = get_attention_backend("cpu")
    assert isinstance(backend, AttentionBackend)
    assert backend.name == "torch_paged"


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 1, 32), (4, 2, 128), (4, 2, 48)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_cpp_prompt_rows_attend_causally(num_heads, num_kv_heads, head_dim, cache_dtype, cpu_isa):
    """A step's prompt rows as the C++ layers hand them to the decode kernel (one query row a token, each with its
    sequence's block table and its position + 1 as context): a fresh 37-token prompt (the AVX-512 path's tiles of
    16, 16 and 5 rows), a decode row, and a 20-token chunk after 17 cached tokens, each row causally against a
    dense reference over the cache as the call left it (head dim 48: the generic path, one row at a time)."""
    ext = load_extension()
    gen = torch.Generator().manual_seed(head_dim)
    block_size, num_blocks, scale = 16, 64, head_dim ** -0.5
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    sequences = [(0, 37), (40, 1), (17, 20)]  # (cached, new)
    tables = [[free.pop() for _ in range(math.ceil((c + n) / block_size))] for c, n in sequences]
    max_blocks = max(len(t) for t in tables)
    row_tables, seq_lens, slots = [], [], []
    for table, (cached, new) in zip(tables, sequences):
        for pos in range(cached, cached + new):
            row_tables.append(table + [0] * (max_blocks - len(table)))
            seq_lens.append(pos + 1)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    num_rows = len(slots)
    q = torch.randn(num_rows, num_heads, head_dim, generator=gen)
    k = torch.randn(num_rows, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_rows, num_kv_heads, head_dim, generator=gen)
    out = ext.paged_decode_attention(q, k, v, k_cache, v_cache, torch.tensor(row_tables, dtype=torch.int32),
                                     torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(slots), scale)
    start = 0
    for table, (cached, new) in zip(tables, sequences):
        positions = torch.arange(cached + new)
        blocks = torch.tensor(table)[positions // block_size]
        context_k = k_cache[blocks, positions % block_size].float()  # [L, Hkv, D], this step's rows included
        context_v = v_cache[blocks, positions % block_size].float()
        rows = slice(start, start + new)
        torch.testing.assert_close(out[rows], dense_attention(q[rows], context_k, context_v, scale),
                                   atol=1e-5, rtol=1e-5, msg=lambda m, cached=cached: f"cached {cached}: {m}")
        start += new
