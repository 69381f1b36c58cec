"""Decode attention with the step's rotary and KV write folded in (`append=`) against the three launches it
replaces: apply_rotary, write_kv_cache, paged_decode_attention."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE, ON_GPU, TOL, PagedKV, poisoned, rel_err, slots_for

from inference_service.model.rope import build_cos_sin_cache
from kernels import FP8_DTYPE, apply_rotary, paged_decode_attention, write_kv_cache
from kernels.decode_prologue import DecodeAppend
from kernels.rotary import Rotary

F32, BF16 = torch.float32, torch.bfloat16


def step_case(lens, num_kv_heads, group, head_dim, dtype, *, cache_dtype=None, splits=None, qk_norm=False,
              rotary=True, window=None, padded=0, tile=None):
    """(fused out, fused caches, unfused out, unfused caches) of one decode step: sequence i holds lens[i] - 1
    cached tokens and appends one; `padded` trailing batch rows have seq_len 0 and slot -1 (a graph's padding);
    `tile`: (block_n, num_warps, num_stages) of both launches."""
    torch.manual_seed(0)
    scales = {"k_scale": 0.05, "v_scale": 0.04} if cache_dtype == FP8_DTYPE else {}
    kv = PagedKV([n - 1 for n in lens], 16, num_kv_heads, head_dim, dtype, cache_dtype=cache_dtype, **scales,
                 spare_blocks=4)
    num_seqs = len(lens) + padded
    # the new token's slot: the next one of the sequence's blocks (the builder leaves a spare column)
    seq_lens = torch.tensor(list(lens) + [0] * padded, dtype=torch.int32, device=DEVICE)
    block_tables = torch.cat([kv.block_tables, torch.zeros(padded, kv.block_tables.shape[1], dtype=torch.int32,
                                                           device=DEVICE)])
    used = set(kv.block_tables.flatten().tolist())
    free = [b for b in range(1, kv.k_cache.shape[0]) if b not in used]
    slots = []
    for i, n in enumerate(lens):
        if (n - 1) % 16 == 0:  # the new token opens a block
            block_tables[i, (n - 1) // 16] = free.pop()
        slots.append(int(slots_for(block_tables[i], n, 16)[-1]))
    slot_mapping = torch.tensor(slots + [-1] * padded, dtype=torch.int64, device=DEVICE)
    num_q_heads = num_kv_heads * group
    qkv = torch.randn(num_seqs, (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    positions = (seq_lens.long() - 1).clamp(min=0)
    table = build_cos_sin_cache(head_dim, 8192, 10000.0, device=DEVICE)  # past the longest context
    norms = {}
    if qk_norm:
        norms = {"q_norm_weight": (1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype),
                 "k_norm_weight": (1 + 0.3 * torch.randn(head_dim, device=DEVICE)).to(dtype), "norm_eps": 1e-6}
    common = {"sliding_window": window, "num_kv_splits": splits, "max_seq_len": max(lens), **scales,
              **dict(zip(("block_n", "num_warps", "num_stages"), tile or ()))}

    def views(t):
        return (t[:, :q_end].view(num_seqs, num_q_heads, head_dim),
                t[:, q_end:k_end].view(num_seqs, num_kv_heads, head_dim),
                t[:, k_end:].view(num_seqs, num_kv_heads, head_dim))

    fused_cache = (kv.k_cache.clone(), kv.v_cache.clone())
    q, k, v = views(qkv.clone())
    spec = Rotary(positions, table, **norms) if rotary else None
    fused = paged_decode_attention(q, *fused_cache, block_tables, seq_lens, head_dim**-0.5,
                                   out=poisoned(q.shape, dtype), append=DecodeAppend(k, v, slot_mapping, spec), **common)

    plain_cache = (kv.k_cache.clone(), kv.v_cache.clone())
    q, k, v = views(qkv.clone())
    if rotary:
        apply_rotary(q, k, positions, table, **norms)
    write_kv_cache(k, v, *plain_cache, slot_mapping, **scales)
    plain = paged_decode_attention(q, *plain_cache, block_tables, seq_lens, head_dim**-0.5,
                                   out=poisoned(q.shape, dtype), **common)
    return fused, fused_cache, plain, plain_cache


def assert_same_cache(fused: tuple, plain: tuple, max_differing: int = 0) -> None:
    """The same slots written (the rest NaN), holding equal values: bit for bit in the interpreter; on the GPU the
    compiler may contract the rotary's products into FMAs differently in the two kernels, so a value may differ
    by its last bit (an fp8 value by one step)."""
    for name, a, b in zip("KV", fused, plain, strict=True):
        a, b = a.float(), b.float()
        assert torch.equal(a.isnan(), b.isnan()), f"{name}: other slots written"
        a, b = a.nan_to_num(), b.nan_to_num()
        differing = int((a != b).sum())
        if ON_GPU:
            step = 0.13 if fused[0].dtype == FP8_DTYPE else 0.01  # e4m3: 3 mantissa bits
            assert torch.allclose(a, b, rtol=step, atol=1e-3), f"{name}: {differing} values differ beyond a rounding"
        else:
            assert differing <= max_differing, f"{name}: {differing} values differ"


LENS = [1, 2, 16, 17, 40, 33] if not ON_GPU else [1, 2, 16, 17, 40, 33, 700, 4097]


@pytest.mark.parametrize("splits", [1, 4, 64] if ON_GPU else [1, 4])  # 4: trailing splits empty at these lengths
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_append_with_rotary_equals_rotary_write_then_attend(splits, dtype):
    fused, fused_cache, plain, plain_cache = step_case(LENS, 2, 3, 64, dtype, splits=splits)
    assert_same_cache(fused_cache, plain_cache)
    # NOTE: on the GPU a rotated q element may round the other way (see assert_same_cache)
    assert rel_err(fused, plain.double()) <= (TOL[dtype] if ON_GPU else TOL[dtype] / 10)


# (16, 1, 6): the one-warp tile a large grid over an fp8 cache takes on Hopper (compiled only on the GPU)
@pytest.mark.parametrize("tile", [None, (16, 1, 6)] if ON_GPU else [None])
@pytest.mark.parametrize("splits", [1, 8])
def test_append_with_qk_norm_fp8_cache_window_and_padding(splits, tile):
    # Qwen3's QK-norm folded as well, e4m3 cache (quantized on the way in), a sliding window, padded rows
    fused, fused_cache, plain, plain_cache = step_case(LENS, 2, 4, 128, BF16, cache_dtype=FP8_DTYPE, splits=splits,
                                                       qk_norm=True, window=20, padded=2, tile=tile)
    # NOTE: the fused norm sums the row's squares in another order: a K value may differ by one rounding
    assert_same_cache(fused_cache, plain_cache, max_differing=2)
    assert rel_err(fused[:-2], plain[:-2].double()) <= TOL[BF16]
    assert torch.equal(fused[-2:], torch.zeros_like(fused[-2:]))  # padding rows: zeros, nothing written


@pytest.mark.parametrize("cache_dtype", [None, FP8_DTYPE], ids=["bf16_cache", "fp8_cache"])
def test_append_multi_head_attention(cache_dtype):
    # one query head a KV head (Phi-3's MHA, head_dim 96): a 16-row query tile holding one head
    fused, fused_cache, plain, plain_cache = step_case(LENS, 3, 1, 96, BF16, cache_dtype=cache_dtype, splits=4)
    assert_same_cache(fused_cache, plain_cache, max_differing=2 if cache_dtype else 0)
    assert rel_err(fused, plain.double()) <= TOL[BF16]


def test_append_without_rotary_writes_k_as_given():
    fused, fused_cache, plain, plain_cache = step_case([5, 16, 17], 1, 8, 80, F32, splits=2, rotary=False)
    assert_same_cache(fused_cache, plain_cache)
    assert torch.equal(fused, plain)


def test_append_checks_arguments():
    kv = PagedKV([5], 16, 2, 64, F32)
    q = torch.randn(1, 4, 64, device=DEVICE)
    k = v = torch.randn(1, 2, 64, device=DEVICE)
    slots = torch.tensor([5], device=DEVICE)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens, 0.125)
    with pytest.raises(ValueError, match="append.k"):
        paged_decode_attention(*args, append=DecodeAppend(k[:, :1], v, slots))
    with pytest.raises(ValueError, match="whole head"):
        table = build_cos_sin_cache(32, 16, 1e4, device=DEVICE)
        paged_decode_attention(*args, append=DecodeAppend(k, v, slots, Rotary(slots, table)))
    with pytest.raises(ValueError, match="both"):
        table = build_cos_sin_cache(64, 16, 1e4, device=DEVICE)
        paged_decode_attention(*args, append=DecodeAppend(k, v, slots, Rotary(slots, table, torch.ones(64))))
