"""Paged decode attention against its float64 reference."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from kernel_testlib import DEVICE, DTYPE_IDS, FP8_ATTN_TOL, ON_GPU, TOL, PagedKV, poisoned, rel_err

from kernels import FP8_DTYPE, paged_decode_attention, paged_decode_attention_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def odd_lens(page: int) -> list[int]:
    return [1, page - 1, page, page + 1]


def run_case(head_dim, num_kv_heads, group, page, dtype, seq_lens, *, splits=None, window=None, cap=None,
             strided_q=False):  # fmt: skip
    kv = PagedKV(seq_lens, page, num_kv_heads, head_dim, dtype)
    num_q_heads = num_kv_heads * group
    b = len(seq_lens)
    if strided_q:  # q as a view of a fused qkv projection output
        qkv = torch.randn(b, (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
        q = qkv[:, : num_q_heads * head_dim].view(b, num_q_heads, head_dim)
    else:
        q = torch.randn(b, num_q_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    out = poisoned(q.shape, dtype)
    paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale, out=out,
                           num_kv_splits=splits, sliding_window=window, soft_cap=cap)  # fmt: skip
    ref = paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, scale,
                                     sliding_window=window, soft_cap=cap)  # fmt: skip
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


# --- the grid -------------------------------------------------------------------------------------

if ON_GPU:
    rng = random.Random(0)
    GRID = []
    for i, (head_dim, group, page, dtype) in enumerate(
        itertools.product((64, 80, 96, 128), (1, 3, 4, 8), (16, 32), (F32, BF16))
    ):
        kind = i % 3
        if kind == 0:
            lens = odd_lens(page) + [4097, rng.randint(2, 6000)]
        elif kind == 1:
            lens = [rng.randint(4097, 9000)]  # batch 1, long: many splits
        else:
            lens = [rng.randint(1, 2048) for _ in range(64)]
        GRID.append((head_dim, group, page, dtype, lens))
    for head_dim, group in itertools.product((64, 80, 96, 128), (1, 3, 4, 8)):
        GRID.append((head_dim, group, 16, F16, odd_lens(16) + [5000]))
else:
    rng = random.Random(0)
    GRID = [
        (64, 1, 16, F32, odd_lens(16)),
        (80, 3, 16, F32, [1, 17, 40]),
        (128, 4, 32, BF16, odd_lens(32)),
        (64, 8, 32, F16, [1, 33]),
        # seeded: the ids carry max(lens), and every pytest-xdist worker must collect the same ones
        (64, 4, 16, BF16, [rng.randint(1, 40) for _ in range(64)]),
        (96, 1, 16, BF16, [1, 17, 40]),  # MHA: one query head a KV head (the dot's 16 rows mostly padding)
        (64, 2, 16, F16, [1, 33]),
    ]


@pytest.mark.parametrize(
    "head_dim,group,page,dtype,lens",
    GRID,
    ids=[f"d{d}-g{g}-p{p}-{DTYPE_IDS[t]}-b{len(lens)}-max{max(lens)}" for d, g, p, t, lens in GRID],
)
def test_decode_grid(head_dim, group, page, dtype, lens):
    num_kv_heads = 2 if ON_GPU else 1
    run_case(head_dim, num_kv_heads, group, page, dtype, lens)  # splits chosen by the launcher
    if ON_GPU or len(lens) < 64:  # (the interpreter runs programs one by one: spare it 64 x 4)
        run_case(head_dim, num_kv_heads, group, page, dtype, lens, splits=1)
        run_case(head_dim, num_kv_heads, group, page, dtype, lens, splits=4 if not ON_GPU else 32)


@pytest.mark.parametrize("splits", [1, 8])
def test_decode_padding_sequence_gives_zeros_and_empty_splits(splits):
    # seq_len 0 is a padded batch entry (CUDA-graph batch sizes); short contexts leave splits empty.
    run_case(64, 1, 4, 16, F32, [0, 5, 16, 1], splits=splits)


@pytest.mark.parametrize("window", [None, 20])
def test_decode_graph_split_count_on_short_contexts(window):
    # A CUDA graph captures 64 splits for the longest context; shorter ones fill a few splits and
    # the merge must read those alone (the unwritten ones hold NaN in the interpreter).
    run_case(64, 1, 4, 16, BF16, [0, 1, 40, 129, 300], splits=64, window=window)


def test_decode_strided_q():
    run_case(80, 2, 3, 16, BF16, [3, 20], strided_q=True)


@pytest.mark.parametrize("window", [1, 7, 16, 100])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_sliding_window(window, splits):
    lens = [1, 15, 16, 17, 40] + ([5000] if ON_GPU else [])
    run_case(64, 1, 4, 16, F32, lens, splits=splits, window=window)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_decode_soft_cap(dtype):
    lens = [1, 17, 33] + ([6000] if ON_GPU else [])
    run_case(80, 2, 3, 16, dtype, lens, cap=2.0, splits=2)
    run_case(128, 1, 4, 32, dtype, lens, cap=30.0, window=20)


def as_fp8(exact: PagedKV, k_scale: float, v_scale: float) -> PagedKV:
    """The same cache stored as fp8: the exact cache's tokens requantized (NaN slots stay NaN)."""
    kv8 = PagedKV.__new__(PagedKV)
    kv8.block_tables, kv8.seq_lens = exact.block_tables, exact.seq_lens
    kv8.k_cache = (exact.k_cache.float() / k_scale).clamp(-448, 448).to(FP8_DTYPE)
    kv8.v_cache = (exact.v_cache.float() / v_scale).clamp(-448, 448).to(FP8_DTYPE)
    return kv8


@pytest.mark.skipif(not ON_GPU, reason="tile configs are compiled only on the GPU (the interpreter ignores them)")
@pytest.mark.parametrize("block_n,num_warps,num_stages", [(32, 4, 5), (64, 4, 5), (64, 4, 7), (128, 4, 5), (64, 8, 5),
                                                         (16, 1, 6)])
@pytest.mark.parametrize("is_fp8", [False, True], ids=["bf16_cache", "fp8_cache"])
def test_decode_tile_configs(block_n, num_warps, num_stages, is_fp8):
    """Deeper K/V pipelines (num_stages) and other tiles compute the same function."""
    lens = [1, 15, 16, 17, 100, 1500, 4097]
    kv = PagedKV(lens, 16, 8, 128, BF16)
    if is_fp8:
        kv = as_fp8(kv, 0.02, 0.03)
    scales = {"k_scale": 0.02, "v_scale": 0.03} if is_fp8 else {}
    q = torch.randn(len(lens), 32, 128, device=DEVICE).to(BF16)
    for splits in (1, 4):
        out = poisoned(q.shape, BF16)
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.088, out=out,
                               num_kv_splits=splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                               **scales)  # fmt: skip
        ref = paged_decode_attention_ref(q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.088, **scales)
        err = rel_err(out, ref)
        assert err <= TOL[BF16], f"splits={splits}: relative error {err:.3g}"


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("head_dim", [64, 128] if not ON_GPU else [64, 80, 96, 128])
def test_decode_fp8_cache(dtype, head_dim, group):
    lens = [1, 16, 17, 40] + ([4097] if ON_GPU else [])
    k_scale, v_scale = 0.02, 0.03
    exact = PagedKV(lens, 16, 2, head_dim, dtype)
    kv8 = as_fp8(exact, k_scale, v_scale)
    q = torch.randn(len(lens), 2 * group, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    for splits in (1, 4):
        out = poisoned(q.shape, dtype)
        paged_decode_attention(q, kv8.k_cache, kv8.v_cache, kv8.block_tables, kv8.seq_lens, scale, out=out,
                               num_kv_splits=splits, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        ref_deq = paged_decode_attention_ref(q, kv8.k_cache, kv8.v_cache, kv8.block_tables, kv8.seq_lens, scale,
                                             k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        ref_exact = paged_decode_attention_ref(q, exact.k_cache, exact.v_cache, exact.block_tables, exact.seq_lens,
                                               scale)  # fmt: skip
        err_deq, err_exact = rel_err(out, ref_deq), rel_err(out, ref_exact)
        print(f"fp8 KV decode d={head_dim} {DTYPE_IDS[dtype]} splits={splits}: vs dequantized {err_deq:.2e}, "
              f"vs unquantized {err_exact:.2e}")  # fmt: skip
        assert err_deq <= TOL[BF16], err_deq  # the kernel computes the dequantized function
        assert err_exact <= FP8_ATTN_TOL, err_exact  # and fp8 storage costs a bounded error


def test_decode_checks_arguments():
    kv = PagedKV([5], 16, 2, 64, F32)
    q = torch.randn(1, 4, 64, device=DEVICE)
    args = (kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.seq_lens, 0.125)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(torch.randn(1, 3, 64, device=DEVICE), *args)
    with pytest.raises(ValueError, match="k_cache"):
        paged_decode_attention(q.to(BF16), *args)
    with pytest.raises(ValueError, match="num_kv_splits"):
        paged_decode_attention(q, *args, num_kv_splits=3)
    with pytest.raises(ValueError, match="v_cache"):
        paged_decode_attention(q, kv.k_cache, kv.v_cache[:, :8], kv.block_tables, kv.seq_lens, 0.125)
