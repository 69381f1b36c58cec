"""The one-kernel MoE router against the model's router (`model/moe.route`: linear, float32 softmax,
`torch.topk`, optional renormalization): the same experts in the same order and the same weights, ties
broken towards the lower expert id, and the launcher's checks."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE

from inference_service.model.moe import route
from kernels import moe_route

# (tokens, hidden, experts, top_k): Mixtral's 8 / 2, a power-of-two-free 6 / 3, Qwen3-MoE's 128 / 8.
SHAPES = [(1, 64, 8, 2), (3, 40, 6, 3), (4, 48, 128, 8)]


class _Moe:
    """What `route` reads of a `SparseMoE`."""

    def __init__(self, weight: torch.Tensor, top_k: int, renormalize: bool):
        self.gate = type("Router", (), {"weight": weight})()
        self.top_k, self.renormalize = top_k, renormalize


def _inputs(shape, dtype, seed=0):
    num_tokens, hidden, num_experts, _ = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(num_experts, hidden, generator=g) / hidden ** 0.5).to(dtype).to(DEVICE)
    return x, weight


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_route_matches_the_model_router_in_fp32(shape, renormalize):
    x, weight = _inputs(shape, torch.float32)
    weights, ids = moe_route(x, weight, shape[3], renormalize)
    ref_weights, ref_ids = route(_Moe(weight, shape[3], renormalize), x)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (shape[0], shape[3])
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_route_in_bf16_rounds_logits_and_weights_as_the_model_does(shape):
    """bf16 logits tie often (8 mantissa bits): the weights must be the router's exactly and each chosen
    expert's probability the router's choice's (either of two tied experts is a right answer)."""
    x, weight = _inputs(shape, torch.bfloat16, seed=1)
    weights, ids = moe_route(x, weight, shape[3], True)
    ref_weights, ref_ids = route(_Moe(weight, shape[3], True), x)
    assert torch.equal(weights, ref_weights.float())  # values of bf16, held in float32
    probs = torch.softmax(torch.nn.functional.linear(x, weight), dim=-1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, ids), probs.gather(1, ref_ids))
    assert all(len(set(row)) == shape[3] for row in ids.tolist())  # k distinct experts a token


def test_ties_go_to_the_lower_expert_id():
    x, weight = _inputs((2, 32, 8, 2), torch.float32)
    weight[5] = weight[3]  # experts 3 and 5 score the same for every token
    x[0] = weight[3] * 4.0  # token 0 prefers them over all others
    weights, ids = moe_route(x, weight, 2, False)
    assert ids[0].tolist() == [3, 5] and weights[0, 0] == weights[0, 1]


def test_route_checks():
    x, weight = _inputs((2, 32, 8, 2), torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(x, weight, 9, True)
    with pytest.raises(ValueError, match="router_weight"):
        moe_route(x, weight[:, :16], 2, True)
    with pytest.raises(ValueError, match="dtype"):
        moe_route(x, weight.to(torch.bfloat16), 2, True)
    weights, ids = moe_route(x[:0], weight, 2, True)
    assert weights.shape == ids.shape == (0, 2)
