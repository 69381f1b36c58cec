"""A mixture-of-experts router: router logits (a GEMV), then one kernel for softmax, top-k and
renormalization.

    logits[t]  = x[t] W_router^T, rounded to x's dtype (as the router's own linear layer rounds them)
    probs[t]   = softmax(logits[t]) in float32 over all E experts
    ids[t]     = the k largest probs, largest first (ties: the lower expert id first)
    weights[t] = probs[t, ids[t]], divided by their sum when `renormalize`, rounded to x's dtype

This is `model/moe.route` (HF's routers: linear, float32 softmax, `torch.topk`, optional renormalization)
for a decode step, where its six small launches (linear, softmax, topk, sum, divide, cast) cost a
Qwen3-MoE layer more than its router reads: here two (the linear, then one program a token holding its E
logits in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    cast,
    next_pow2,
    pdl_args,
    pdl_enter,
    require,
    require_dtype,
    require_same_device,
)
from kernels.gemv import MAX_GEMV_ROWS, gemv

# Router rows (experts) one program holds; Qwen3-MoE has 128, Mixtral 8, DeepSeek-V3 256.
MAX_ROUTE_EXPERTS = 256


@triton.jit
def _moe_top_k_kernel(
    logits_ptr,  # [T, E] router logits, in x's dtype
    weights_ptr,  # [T, TOP_K] float32 out
    ids_ptr,  # [T, TOP_K] int64 out
    E,
    stride_logits,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    logits = tl.load(logits_ptr + token * stride_logits + offs_e, mask=e_mask, other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    # NOTE: each expert's rank (the experts before it: a larger prob, or an equal one and a lower id) from one
    # [E, E] comparison, instead of k rounds of max and argmin: 3 reductions instead of 2 k (H100: 3.3 us a layer)
    p_other, e_other = probs[None, :], offs_e[None, :]
    before = (p_other > probs[:, None]) | ((p_other == probs[:, None]) & (e_other < offs_e[:, None]))  # [BE, BE]
    rank = tl.sum(before.to(tl.int32), axis=1)  # [BLOCK_E]
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < TOP_K
    is_choice = (rank[:, None] == offs_k[None, :]) & k_mask[None, :]  # [BLOCK_E, BLOCK_K]: expert e is choice j
    top_weights = tl.sum(tl.where(is_choice, probs[:, None], 0.0), axis=0)  # [BLOCK_K], largest first
    top_ids = tl.sum(tl.where(is_choice, offs_e[:, None], 0), axis=0).to(tl.int64)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=0)
    top_weights = cast(top_weights, logits_ptr.dtype.element_ty).to(tl.float32)  # the router's output dtype
    tl.store(weights_ptr + token * TOP_K + offs_k, top_weights, mask=k_mask)
    tl.store(ids_ptr + token * TOP_K + offs_k, top_ids, mask=k_mask)


def moe_route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], router_weight [E, H] -> (weights [T, k] float32 holding values of x's dtype, expert ids
    [T, k] int64), as `model/moe.route` computes them (see the module doc)."""
    require(x.dim() == 2 and router_weight.dim() == 2 and router_weight.shape[1] == x.shape[1],
            lambda: f"x {tuple(x.shape)} and router_weight {tuple(router_weight.shape)}: expected [T, H] and [E, H]")
    num_tokens = x.shape[0]
    num_experts = router_weight.shape[0]
    require(0 < top_k <= num_experts, lambda: f"top_k must be in [1, {num_experts}] (the experts), got {top_k}")
    require(num_experts <= MAX_ROUTE_EXPERTS, lambda: f"{num_experts} experts: at most {MAX_ROUTE_EXPERTS}")
    require_dtype("x", x, ACT_DTYPES)
    require(router_weight.dtype == x.dtype, lambda: f"router_weight: dtype {router_weight.dtype} differs from x's {x.dtype}")
    require(x.stride(1) == 1 and router_weight.stride(1) == 1, "x and router_weight rows must be contiguous")
    require_same_device(x=x, router_weight=router_weight)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=x.device)
    if num_tokens:
        # NOTE: one program a token reading all E router rows ran at a few GB/s (77 us a layer on an H200);
        # the logits come from a GEMV over the rows instead: ours at decode sizes (launched with PDL like
        # the kernels around it; cuBLAS's took 5 us), the library matmul past them.
        logits = (gemv(x, router_weight) if num_tokens <= MAX_GEMV_ROWS
                  else torch.nn.functional.linear(x, router_weight))  # [T, E] in x's dtype
        _moe_top_k_kernel[(num_tokens,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                         RENORMALIZE=renormalize, BLOCK_K=next_pow2(top_k),
                                         BLOCK_E=next_pow2(num_experts), **pdl_args(x.device))
    return weights, ids
