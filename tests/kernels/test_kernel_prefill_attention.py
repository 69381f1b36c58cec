"""Paged prefill / extend attention against its float64 reference."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from kernel_testlib import DEVICE, DTYPE_IDS, FP8_ATTN_TOL, ON_GPU, TOL, PagedKV, poisoned, rel_err

from kernels import FP8_DTYPE, paged_prefill_attention, paged_prefill_attention_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def run_case(head_dim, num_kv_heads, group, page, dtype, seqs, *, window=None, cap=None, extra_rows=2, kv=None,
             k_scale=1.0, v_scale=1.0, tol=None, ref_kv=None):  # fmt: skip
    """seqs: (query_len, seq_len) per sequence; the queries are the last query_len tokens."""
    seq_lens = [s for _, s in seqs]
    kv = kv or PagedKV(seq_lens, page, num_kv_heads, head_dim, dtype)
    q_lens = [n for n, _ in seqs]
    num_tokens = sum(q_lens)
    # rows past query_start_loc[-1] (padding up to a captured size) must stay untouched
    q = torch.randn(num_tokens + extra_rows, num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = poisoned(q.shape, dtype)
    paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, max(q_lens), scale,
                            out=out, sliding_window=window, soft_cap=cap, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    ref_kv = ref_kv or kv
    ref_scales = (k_scale, v_scale) if ref_kv is kv else (1.0, 1.0)
    ref = paged_prefill_attention_ref(q, ref_kv.k_cache, ref_kv.v_cache, ref_kv.block_tables, qsl, ref_kv.seq_lens,
                                      scale, sliding_window=window, soft_cap=cap, k_scale=ref_scales[0],
                                      v_scale=ref_scales[1])  # fmt: skip
    assert out[num_tokens:].isnan().all(), "rows past the batch were written"
    err = rel_err(out[:num_tokens], ref[:num_tokens])
    bound = tol or TOL[dtype]
    assert err <= bound, f"relative error {err:.3g} > {bound}"
    return err


def odd_seqs(page: int) -> list[tuple[int, int]]:
    return [
        (1, 1),  # context 1
        (page - 1, page - 1),
        (page, page),
        (page + 1, page + 1),
        (3, 2 * page + 5),  # extend: chunk over a cached prefix
        (1, page + 1),  # a decode row in a mixed batch
    ]


if ON_GPU:
    rng = random.Random(1)
    GRID = []
    for i, (head_dim, group, page, dtype) in enumerate(
        itertools.product((64, 80, 96, 128), (1, 3, 4, 8), (16, 32), (F32, BF16))
    ):
        kind = i % 3
        if kind == 0:
            seqs = odd_seqs(page) + [(rng.randint(100, 700), rng.randint(1000, 3000))]
        elif kind == 1:
            seqs = [(4097, 4097)]  # > 4k prefill, batch 1
        else:
            seqs = [(n, n + rng.randint(0, 300)) for n in (rng.randint(1, 200) for _ in range(64))]
        GRID.append((head_dim, group, page, dtype, seqs))
    for head_dim, group in itertools.product((64, 80, 96, 128), (1, 3, 4, 8)):
        GRID.append((head_dim, group, 16, F16, odd_seqs(16) + [(300, 4500)]))
else:
    GRID = [
        (64, 1, 16, F32, odd_seqs(16)),
        (80, 3, 16, F32, [(17, 17), (20, 50)]),
        (128, 4, 32, BF16, odd_seqs(32)[:4]),
        (64, 8, 32, F16, [(5, 40)]),
    ]


@pytest.mark.parametrize(
    "head_dim,group,page,dtype,seqs",
    GRID,
    ids=[f"d{d}-g{g}-p{p}-{DTYPE_IDS[t]}-b{len(s)}-maxq{max(n for n, _ in s)}" for d, g, p, t, s in GRID],
)
def test_prefill_grid(head_dim, group, page, dtype, seqs):
    run_case(head_dim, 2 if ON_GPU else 1, group, page, dtype, seqs)


def test_prefill_batch_of_many_short_sequences():
    seqs = [(random.randint(1, 3), random.randint(3, 20)) for _ in range(64 if ON_GPU else 24)]
    run_case(64, 1, 4, 16, BF16, seqs)


def test_prefill_empty_query_sequence():
    run_case(64, 1, 2, 16, F32, [(3, 3), (0, 7), (2, 9)])  # a sequence with no new tokens


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_prefill_sliding_window(window):
    seqs = [(1, 1), (16, 16), (17, 17), (9, 40)] + ([(3000, 4500)] if ON_GPU else [])
    run_case(64, 1, 4, 16, F32, seqs, window=window)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_prefill_soft_cap(dtype):
    seqs = [(1, 1), (17, 17), (6, 33)] + ([(2000, 2500)] if ON_GPU else [])
    run_case(80, 2, 3, 16, dtype, seqs, cap=2.0)
    run_case(128, 1, 4, 32, dtype, seqs, cap=30.0, window=12)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_prefill_fp8_cache(dtype):
    seqs = [(1, 1), (16, 16), (5, 40)] + ([(1000, 4097)] if ON_GPU else [])
    k_scale, v_scale = 0.02, 0.03
    exact = PagedKV([s for _, s in seqs], 16, 2, 128, dtype)
    kv8 = PagedKV.__new__(PagedKV)
    kv8.block_tables, kv8.seq_lens = exact.block_tables, exact.seq_lens
    kv8.k_cache = (exact.k_cache.float() / k_scale).clamp(-448, 448).to(FP8_DTYPE)
    kv8.v_cache = (exact.v_cache.float() / v_scale).clamp(-448, 448).to(FP8_DTYPE)
    err_deq = run_case(128, 2, 4, 16, dtype, seqs, kv=kv8, k_scale=k_scale, v_scale=v_scale, tol=TOL[BF16])
    err_exact = run_case(128, 2, 4, 16, dtype, seqs, kv=kv8, k_scale=k_scale, v_scale=v_scale,
                         tol=FP8_ATTN_TOL, ref_kv=exact)  # fmt: skip
    print(f"fp8 KV prefill {DTYPE_IDS[dtype]}: vs dequantized {err_deq:.2e}, vs unquantized {err_exact:.2e}")


def test_prefill_checks_arguments():
    kv = PagedKV([5], 16, 2, 64, F32)
    q = torch.randn(5, 4, 64, device=DEVICE)
    qsl = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl[:1], kv.seq_lens, 5, 0.125)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, qsl.long(), kv.seq_lens, 5, 0.125)
    with pytest.raises(ValueError, match="num_kv_heads"):
        paged_prefill_attention(q[:, :3], kv.k_cache, kv.v_cache, kv.block_tables, qsl, kv.seq_lens, 5, 0.125)
