"""Mixture-of-experts MLP (Qwen3-MoE, Mixtral): the parameters, top-k routing, the CPU path, and the
checkpoint layouts its expert weights come in.

A sparse layer's MLP is a `SparseMoE` in place of the dense `MLP` (`layers.DecoderLayer`); the rest
of the decoder is the same. Per token::

    probs = softmax(x Wg^T)                  float32, over all experts
    top_w, top_ids = topk(probs, k)          torch.topk: ties resolve exactly as in HF's code
    top_w /= sum(top_w)                      Mixtral always, Qwen3-MoE when norm_topk_prob
    y = sum_j top_w[j] * down_e(silu(gate_e(x)) * up_e(x)),  e = top_ids[j]

Expert weights are kept stacked, as HF (v5) and the fused kernel hold them:

    mlp.gate.weight                 [E, H]        the router (Mixtral: block_sparse_moe.gate)
    mlp.experts.gate_up_proj        [E, 2 I, H]   gate rows then up rows of each expert
    mlp.experts.down_proj           [E, H, I]

`stack_expert_weights` builds them from per-expert checkpoints (`mlp.experts.{e}.gate_proj/up_proj/
down_proj.weight`; Mixtral's `experts.{e}.w1/w3/w2.weight`) and from stacked per-projection ones
(`mlp.experts.gate_proj/up_proj` [E, I, H], as GGUF's `ffn_gate_exps` / `ffn_up_exps` store them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.cpu_kernels.quant import QuantizedWeight, dequantize_rows
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig
from inference_service.model.norms import _param


class Router(nn.Module):
    """The router's [E, H] weight, applied in the model dtype as HF applies it (`F.linear`, never a
    packed or quantized variant: equal logits must stay bitwise equal for ties to resolve as in HF)."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = _param(num_experts, hidden_size, dtype=dtype, device=device)


class Experts(nn.Module):
    """The experts' stacked weights: `gate_up_proj` [E, 2 I, H], `down_proj` [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.gate_up_proj = _param(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device)
        self.down_proj = _param(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device)


class SparseMoE(nn.Module):
    """A sparse MLP's parameters (router and experts) and its routing numbers; no forward (the
    stacks run it: `moe_forward` here on the CPU, `kernels.fused_moe` on the fused stack)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.intermediate_size = config.moe_intermediate_size
        self.renormalize = config.norm_topk_prob
        self.gate = Router(self.num_experts, config.hidden_size, dtype, device)
        self.experts = Experts(self.num_experts, config.hidden_size, self.intermediate_size, dtype, device)


def route(moe: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (top-k weights [T, k] in x's dtype, expert ids [T, k] int64), as HF's routers
    compute them: softmax in float32 over every expert, `torch.topk`, optional renormalization."""
    logits = F.linear(x, moe.gate.weight)  # [T, E] in the model dtype
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def moe_forward(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """x [T, H] (normed) -> the MoE output [T, H]: routed, then the tokens grouped by expert and each
    expert's rows run as one matmul (the CPU path; the GPU runs `kernels.fused_moe`)."""
    weights, ids = route(moe, x)
    return experts_forward(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids)


def experts_forward(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], gate_up_proj [E, 2 I, H], down_proj [E, H, I], weights/ids [T, k] -> [T, H].

    The T * k (token, expert) pairs are sorted by expert; each expert with rows runs gate_up, the
    SiLU gate and down over its rows at once, and the weighted rows are added into their tokens in
    expert order (as HF adds them, so fp32 results agree to rounding)."""
    top_k = ids.shape[1]
    intermediate = down_proj.shape[2]
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pair indices grouped by expert, tokens ascending
    counts = torch.bincount(flat_ids, minlength=gate_up_proj.shape[0]).tolist()
    tokens = order // top_k
    pair_weights = weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start:start + count]
        gate_up = F.linear(x.index_select(0, rows), gate_up_proj[expert])  # [n, 2 I]
        h = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        y = F.linear(h, down_proj[expert]) * pair_weights[start:start + count, None]  # [n, H]
        out.index_add_(0, rows, y)
        start += count
    return out


# ---------------------------------------------------------------------- checkpoint layouts

# model.layers.{i}.mlp.experts.{e}.{proj}.weight (Mixtral's block_sparse_moe renamed to mlp already)
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# model.layers.{i}.mlp.experts.{gate_proj,up_proj,down_proj} [E, rows, cols] (GGUF ffn_*_exps)
_STACKED_PART = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)(?:\.weight)?$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def stack_expert_weights(config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with expert weights in our stacked layout (module docstring). A layer's
    stacked tensor is yielded once all of its parts have been read; one never completed is left
    out, and `load_weights` then names it as missing."""
    num_experts = config.num_experts
    pending: dict[tuple[str, str], dict[int | None, torch.Tensor]] = {}  # (prefix, part) -> expert -> rows
    for name, tensor in weights:
        per_expert, stacked = _PER_EXPERT.match(name), _STACKED_PART.match(name)
        if per_expert is None and stacked is None:
            yield name, tensor
            continue
        if isinstance(tensor, QuantizedWeight):
            tensor = dequantize_rows(tensor)
        if per_expert is not None:
            prefix, expert, part = per_expert.group(1), int(per_expert.group(2)), _PART[per_expert.group(3)]
            if expert >= num_experts:
                raise UnsupportedModelError(f"weight {name!r} names expert {expert} of {num_experts}")
        else:
            prefix, expert, part = stacked.group(1), None, _PART[stacked.group(2)]
            if tensor.dim() != 3 or tensor.shape[0] != num_experts:
                raise UnsupportedModelError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected [{num_experts}, rows, cols]")
        pending.setdefault((prefix, part), {})[expert] = tensor
        yield from _complete(prefix, pending, num_experts)


def _stacked(parts: dict[int | None, torch.Tensor] | None, num_experts: int) -> torch.Tensor | None:
    if parts is None:
        return None
    if None in parts:
        return parts[None]
    if len(parts) < num_experts:
        return None
    return torch.stack([parts[e] for e in range(num_experts)])


def _complete(prefix: str, pending: dict, num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    gate = _stacked(pending.get((prefix, "gate")), num_experts)
    up = _stacked(pending.get((prefix, "up")), num_experts)
    if gate is not None and up is not None:
        del pending[(prefix, "gate")], pending[(prefix, "up")]
        if gate.shape != up.shape:
            raise UnsupportedModelError(f"{prefix}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        yield f"{prefix}.gate_up_proj", torch.cat((gate, up), dim=1)
    down = _stacked(pending.get((prefix, "down")), num_experts)
    if down is not None:
        del pending[(prefix, "down")]
        yield f"{prefix}.down_proj", down
