"""The fused MoE kernel against the per-expert loop: the float64 reference and the model's CPU path
(`model/moe.experts_forward`), over odd shapes, skewed routing (experts with no tokens, one expert
with most) and every dtype; the alignment's exact layout; and the launcher's checks."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_testlib import DEVICE, DTYPE_IDS, ON_GPU, TOL, rel_err

from inference_service.model.moe import experts_forward
from kernels import align_pairs_by_expert, fused_moe, fused_moe_ref
from kernels.moe import decode_max_pairs

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (tokens, hidden, intermediate, experts, top_k)
SHAPES = ([(1, 64, 32, 8, 2), (7, 48, 40, 6, 3), (33, 80, 24, 5, 2), (200, 256, 96, 16, 4)] if ON_GPU
          else [(1, 40, 24, 8, 2), (7, 48, 40, 6, 3), (21, 36, 20, 5, 2)])
GRID = list(itertools.product(SHAPES, (F32, F16, BF16)))


def _routing(num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator):
    """Distinct experts per token, skewed: expert 0 in most tokens, the last expert in none."""
    scores = torch.rand(num_tokens, num_experts - 1, generator=generator)
    scores[:, 0] += 0.8
    ids = torch.topk(scores, top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), dim=-1)
    return weights, ids


def _case(shape, dtype):
    num_tokens, hidden, intermediate, num_experts, top_k = shape
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    weights, ids = _routing(num_tokens, num_experts, top_k, g)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids)]


@pytest.mark.parametrize("shape,dtype", GRID, ids=[f"{'x'.join(map(str, s))}-{DTYPE_IDS[d]}" for s, d in GRID])
def test_fused_moe_matches_per_expert_loop(shape, dtype):
    x, w13, w2, weights, ids = _case(shape, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) <= TOL[dtype]
    if dtype == F32:  # the model's CPU path (tokens grouped by expert) is the same loop
        loop = experts_forward(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
        torch.testing.assert_close(out.cpu(), loop, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_gemv", [True, False], ids=["gemv", "gemm"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_fused_moe_gemv_and_gemm_paths_match_the_loop(shape, use_gemv):
    """Either path at any number of pairs (the default picks the GEMVs up to `decode_max_pairs`)."""
    for dtype in (F32, BF16):
        x, w13, w2, weights, ids = _case(shape, dtype)
        out = fused_moe(x, w13, w2, weights, ids, use_gemv=use_gemv)
        assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) <= TOL[dtype], dtype


@pytest.mark.parametrize("use_gemv", [True, False], ids=["gemv", "gemm"])
def test_fused_moe_adds_the_residual(use_gemv):
    """The decoder's residual add folded into the down projection: out = MoE(x) + residual."""
    x, w13, w2, weights, ids = _case((3, 48, 40, 6, 3), F32)
    residual = torch.randn(x.shape, device=DEVICE)
    out = fused_moe(x, w13, w2, weights, ids, use_gemv=use_gemv, residual=residual)
    expected = fused_moe_ref(x, w13, w2, weights, ids) + residual.double()
    assert rel_err(out, expected) <= TOL[F32]
    with pytest.raises(ValueError, match="residual"):
        fused_moe(x, w13, w2, weights, ids, residual=residual[:, :8])


def test_fused_moe_picks_the_gemvs_for_decode_sized_batches():
    assert decode_max_pairs(128, 8) == 64 and decode_max_pairs(8, 2) == 4
    x, w13, w2, weights, ids = _case((2, 40, 24, 8, 2), F32)  # 4 pairs: GEMVs by default
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe(x, w13, w2, weights, ids, use_gemv=True))


def test_fused_moe_block_sizes_agree():
    x, w13, w2, weights, ids = _case((9, 40, 24, 4, 2), F32)
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    for block_m in (16, 32):
        assert rel_err(fused_moe(x, w13, w2, weights, ids, block_m=block_m), expected) <= TOL[F32]


def test_align_pairs_by_expert_layout():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)  # pairs 0..5; expert 1 unused
    sorted_pairs, block_expert = align_pairs_by_expert(ids, num_experts=4, block_m=2)
    pad = ids.numel()
    # expert 0: pairs 1, 4 | expert 2: pairs 0, 2, 5 (+ pad) | expert 3: pair 3 (+ pad) | a spare block
    # (the bound: 6 pairs + 4 experts x (2 - 1) padding = 10 entries)
    assert sorted_pairs.tolist() == [1, 4, 0, 2, 5, pad, 3, pad, pad, pad]
    assert block_expert.tolist() == [0, 2, 2, 3, 4]


def test_fused_moe_checks():
    x, w13, w2, weights, ids = _case((3, 40, 24, 4, 2), F32)
    with pytest.raises(ValueError, match="down_proj"):
        fused_moe(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="gate_up_proj: dtype"):
        fused_moe(x, w13.to(BF16), w2, weights, ids)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_fused_moe_is_cuda_graph_capturable():
    """The decode step is captured in a CUDA graph: routing alignment and both GEMMs must not sync
    with the host. Replayed on new routing, the graph gives the eager result."""
    for num_tokens in (2, 4):  # 4 pairs: the GEMVs; 8: the grouped GEMMs
        x, w13, w2, weights, ids = _case((num_tokens, 64, 32, 8, 2), BF16)
        fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe(x, w13, w2, weights, ids)
        new_weights, new_ids = _routing(num_tokens, 8, 2, torch.Generator().manual_seed(5))
        weights.copy_(new_weights.to(BF16))
        ids.copy_(new_ids)
        graph.replay()
        assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))
