"""The Triton attention backend against the torch paged backend, on the engine's own metadata.

Runs compiled on a GPU, else in Triton's interpreter (conftest.py). Each case is one model step over
a batch of sequences given as (tokens already cached, new tokens): prefills from scratch, chunked
prefills and prefix-cache hits (cached > 0, new > 1), and decodes (new == 1). Both backends get the
same cache contents; the Triton copy has every slot no sequence owns set to NaN, so a read outside a
context fails. Checked: the written cache slots bit for bit, the outputs by relative error.
"""

from __future__ import annotations

import json

import pytest
import torch

from inference_service.attention.backend import get_attention_backend
from inference_service.attention.metadata import AttentionMetadata
from inference_service.attention.torch_paged import TorchPagedAttention
from inference_service.attention.triton_backend import TritonPagedAttention
from tests.kernels.kernel_testlib import DEVICE, TOL, rel_err

CASES = {
    "decode_only": [(0, 1), (16, 1), (37, 1), (5, 1)],
    "prefill_only": [(0, 7), (0, 16), (0, 33)],
    "mixed": [(0, 9), (20, 1), (16, 12), (3, 1), (31, 2)],  # fresh, decode, prefix hit, decode, chunk
    # Leading decodes run the decode kernel, the rest the prefill kernel, into one output.
    "mixed_decodes_first": [(20, 1), (3, 1), (47, 1), (0, 9), (16, 12), (5, 1)],
}


def _step(seqs: list[tuple[int, int]], block_size: int, num_blocks: int, gen: torch.Generator,
          tables: torch.Tensor | None = None):
    """Metadata of one step over `seqs` [(num_cached, num_new)], with distinct random blocks per sequence
    (block 0 left unowned, as the engine's padding target) unless `tables` [S, NB] int32 is given."""
    seq_lens = [c + n for c, n in seqs]
    needed = [-(-n // block_size) for n in seq_lens]
    if tables is None:
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        tables = torch.zeros((len(seqs), max(needed) + 1), dtype=torch.int32)  # one spare padding column
        used = 0
        for i, count in enumerate(needed):
            tables[i, :count] = torch.tensor(perm[used:used + count], dtype=torch.int32)
            used += count
    slots, starts, owned = [], [0], []
    for i, (cached, new) in enumerate(seqs):
        pos = torch.arange(cached + new)
        seq_slots = tables[i].long()[pos // block_size] * block_size + pos % block_size  # [L]
        owned.append(seq_slots)
        slots.append(seq_slots[cached:])
        starts.append(starts[-1] + new)
    md = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        num_decode_seqs=next((i for i, (_, n) in enumerate(seqs) if n != 1), len(seqs)),
    )
    return md, torch.cat(owned), torch.cat(slots)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,head_dim,block_size", [((4, 2), 64, 16), ((6, 1), 128, 32)], ids=["gqa2", "mqa6"])
def test_triton_backend_matches_torch(case, dtype, heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(hash((case, str(dtype), head_dim)) % 2**31)
    num_q_heads, num_kv_heads = heads
    num_blocks = 24
    md, owned_slots, new_slots = _step(CASES[case], block_size, num_blocks, gen)
    num_tokens = md.query_start_loc_cpu[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    # q/k/v as strided views of one fused projection, as the decoder hands them over.
    qkv = rand(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim).view(num_tokens, -1, head_dim)
    q, k, v = qkv[:, :num_q_heads], qkv[:, num_q_heads:num_q_heads + num_kv_heads], qkv[:, num_q_heads + num_kv_heads:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    ref_k, ref_v = rand(*cache_shape), rand(*cache_shape)
    tri_k, tri_v = (torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    for src, dst in ((ref_k, tri_k), (ref_v, tri_v)):
        dst.view(-1, num_kv_heads, head_dim)[owned_slots] = src.view(-1, num_kv_heads, head_dim)[owned_slots]

    scale = head_dim ** -0.5
    # Reference: the torch backend in float64 on the same inputs.
    ref = TorchPagedAttention().forward(q.double(), k.double(), v.double(), ref_k.double(), ref_v.double(),
                                        md, scale)  # [T, Hq, D]
    out = TritonPagedAttention().forward(q, k, v, tri_k, tri_v, md, scale)

    for name, tri, src in (("k", tri_k, k), ("v", tri_v, v)):
        written = tri.view(-1, num_kv_heads, head_dim)[new_slots]
        assert torch.equal(written, src), f"{name} cache slots differ from the step's new {name}"
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiling_every_variant_launches_each_and_keeps_the_output(dtype, monkeypatch):
    """A mixed step inside `compiling_every_variant` (what the engine runs once before serving) launches its
    decode attention at every (splits, tile) variant, and still returns the step's attention."""
    import kernels

    gen = torch.Generator().manual_seed(5)
    md, owned_slots, _ = _step(CASES["mixed_decodes_first"], 16, 24, gen)
    num_tokens = md.query_start_loc_cpu[-1]
    q, k, v = (torch.randn(num_tokens, h, 64, generator=gen).to(dtype=dtype, device=DEVICE) for h in (4, 2, 2))
    k_cache, v_cache = (torch.randn(24, 16, 2, 64, generator=gen).to(dtype=dtype, device=DEVICE) for _ in range(2))
    expected = TritonPagedAttention().forward(q, k, v, k_cache.clone(), v_cache.clone(), md, 0.125)
    launches = []
    launch = kernels.paged_decode_attention
    monkeypatch.setattr(kernels, "paged_decode_attention", lambda *a, **kw: launches.append(
        tuple(kw.get(name) for name in kernels.DecodeLaunch._fields)) or launch(*a, **kw))
    backend = TritonPagedAttention()
    with backend.compiling_every_variant(dtype, k_cache):
        out = backend.forward(q, k, v, k_cache, v_cache, md, 0.125)
    variants = kernels.decode_launch_variants(dtype, k_cache)
    assert {launch.num_kv_splits for launch in variants} == {1, 2}
    assert launches == [tuple(launch) for launch in variants]
    assert rel_err(out, expected) < TOL[dtype]
    backend.forward(q, k, v, k_cache, v_cache, md, 0.125)  # outside: one launch again
    assert len(launches) == len(variants) + 1


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_decoder_on_triton_backend_matches_torch(tmp_path, model_type):
    """A tiny dummy-weight decoder through a prefill step then two decode steps: the Triton backend's
    hidden states equal the torch backend's (fp32), q/k/v coming as views of the fused projection."""
    from inference_service.model.dummy import load_dummy_model

    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    config = {"architectures": [arch], "model_type": model_type, "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64, "head_dim": 64,
              "rope_theta": 10000.0, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    models = [load_dummy_model(str(tmp_path), device=DEVICE, dtype=torch.float32, seed=1, attention_backend=name)[1]
              for name in ("torch", "triton")]
    block_size, num_blocks = 16, 12
    caches = [[(torch.zeros(num_blocks, block_size, 1, 64, device=DEVICE),
                torch.zeros(num_blocks, block_size, 1, 64, device=DEVICE)) for _ in range(2)] for _ in models]
    gen = torch.Generator().manual_seed(0)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[:6] + 1).to(torch.int32).view(2, 3)  # 3 blocks a seq
    prompt_lens = [19, 7]
    steps = [[(0, n) for n in prompt_lens], [(n, 1) for n in prompt_lens], [(n + 1, 1) for n in prompt_lens]]
    for seqs in steps:
        md, _, _ = _step(seqs, block_size, num_blocks, gen, tables=tables)
        tokens = torch.randint(0, 64, (md.query_start_loc_cpu[-1],), generator=gen).to(DEVICE)  # [T]
        positions = torch.tensor([p for c, n in seqs for p in range(c, c + n)], device=DEVICE)  # [T]
        hidden = [m(tokens, positions, kv, md) for m, kv in zip(models, caches)]  # [T, H] each
        assert rel_err(hidden[1], hidden[0].double()) < 1e-5


def test_get_attention_backend_by_device_and_name():
    assert isinstance(get_attention_backend("cpu"), TorchPagedAttention)
    assert isinstance(get_attention_backend(torch.device("cuda", 0)), TritonPagedAttention)
    assert isinstance(get_attention_backend("cuda:1", "torch"), TorchPagedAttention)
    assert isinstance(get_attention_backend("cpu", "triton"), TritonPagedAttention)
    with pytest.raises(ValueError, match="attention backend"):
        get_attention_backend("cpu", "flash")


def test_padded_decode_rows_touch_nothing():
    """A decode step padded to a CUDA-graph batch size (padding rows: slot -1, seq_len 0) gives the real
    rows bit-identical outputs, writes no cache slot for the padding and returns zeros for it."""
    gen = torch.Generator().manual_seed(5)
    block_size, num_blocks, num_kv_heads, head_dim = 16, 12, 2, 64
    md, _, _ = _step([(20, 1), (3, 1)], block_size, num_blocks, gen)
    num_pad = 3
    padded = AttentionMetadata(
        slot_mapping=torch.cat([md.slot_mapping, torch.full((num_pad,), -1, device=DEVICE)]),
        query_start_loc=torch.arange(2 + num_pad + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.cat([md.seq_lens, torch.zeros(num_pad, dtype=torch.int32, device=DEVICE)]),
        block_tables=torch.cat([md.block_tables, md.block_tables[:1].expand(num_pad, -1)]),
        max_query_len=1, max_seq_len=md.max_seq_len, query_start_loc_cpu=list(range(2 + num_pad + 1)),
        seq_lens_cpu=md.seq_lens_cpu + [0] * num_pad)
    q, k, v = (torch.randn(2 + num_pad, h, head_dim, generator=gen).to(DEVICE) for h in (4, 2, 2))
    caches = [tuple(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE)
                    for _ in range(2)) for _ in range(2)]
    caches[1] = tuple(c.clone() for c in caches[0])
    backend = TritonPagedAttention()
    out = backend.forward(q[:2], k[:2], v[:2], *caches[0], md, 0.125)
    out_padded = backend.forward(q, k, v, *caches[1], padded, 0.125)
    assert torch.equal(out_padded[:2], out)
    assert torch.equal(out_padded[2:], torch.zeros_like(out_padded[2:]))
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1]))


# Whole fresh prompts past MIN_DENSE_PREFILL_TOKENS (after leading decodes) take torch's SDPA (dense_prefill.py)
DENSE_CASES = {
    "fresh_prompts": [(0, 300), (0, 240)],
    "one_fresh_prompt": [(0, 530)],  # SDPA's output returned as is
    "decodes_then_fresh_prompts": [(20, 1), (3, 1), (0, 530)],
}


@pytest.mark.parametrize("case", sorted(DENSE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fresh_prompts_take_sdpa_and_match_torch(case, dtype):
    import types

    import kernels

    gen = torch.Generator().manual_seed(7)
    num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 64, 16, 48
    md, owned_slots, new_slots = _step(DENSE_CASES[case], block_size, num_blocks, gen)
    num_tokens = md.query_start_loc_cpu[-1]
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype=dtype,
                                                                                                  device=DEVICE)
    qkv = qkv.view(num_tokens, -1, head_dim)
    q, k, v = qkv[:, :num_q_heads], qkv[:, num_q_heads:num_q_heads + num_kv_heads], qkv[:, num_q_heads + num_kv_heads:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    ref_k, ref_v = (torch.randn(*cache_shape, generator=gen).to(dtype=dtype, device=DEVICE) for _ in range(2))
    tri_k, tri_v = (torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2))
    for src, dst in ((ref_k, tri_k), (ref_v, tri_v)):
        dst.view(-1, num_kv_heads, head_dim)[owned_slots] = src.view(-1, num_kv_heads, head_dim)[owned_slots]
    scale = head_dim ** -0.5
    ref = TorchPagedAttention().forward(q.double(), k.double(), v.double(), ref_k.double(), ref_v.double(), md, scale)
    backend = TritonPagedAttention(dense_prefill=True)
    # Without the paged prefill kernel: a step routed to it fails instead of passing unnoticed
    backend._kernels = types.SimpleNamespace(write_kv_cache=kernels.write_kv_cache,
                                             paged_decode_attention=kernels.paged_decode_attention,
                                             choose_num_kv_splits=kernels.choose_num_kv_splits)
    out = backend.forward(q, k, v, tri_k, tri_v, md, scale)
    for name, tri, src in (("k", tri_k, k), ("v", tri_v, v)):
        assert torch.equal(tri.view(-1, num_kv_heads, head_dim)[new_slots], src), f"{name} cache not written"
    assert rel_err(out, ref) < TOL[dtype]


def test_which_steps_take_the_dense_prefill():
    from inference_service.attention.dense_prefill import fresh_prefill_spans

    def spans(seqs, first=None, **kw):
        md, _, _ = _step(seqs, 16, 256, torch.Generator().manual_seed(0))
        return fresh_prefill_spans(md, md.num_decode_seqs if first is None else first, **kw)

    assert spans([(0, 600)]) == [(0, 600)]
    assert spans([(5, 1), (0, 300), (0, 300)]) == [(1, 301), (301, 601)]
    assert spans([(0, 300), (16, 300)]) is None  # a prefix-cache hit: its keys are in the cache only
    assert spans([(0, 500)]) is None  # too few tokens to beat one paged launch
    assert spans([(0, 200)] * 5) is None  # too many prompts for a host loop
    assert spans([(0, 600)], soft_cap=50.0) is None  # SDPA has no soft cap
    assert spans([(0, 600)], sliding_window=512) is None
    assert spans([(0, 600)], sliding_window=4096) == [(0, 600)]
    assert spans([(3, 1), (4, 1)]) is None  # decodes only: nothing left for a prefill path
