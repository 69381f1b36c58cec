"""Checkpoint tensors -> the decoder's parameter names and layouts, per family (`FamilySpec`).

Three things differ between families beyond names of fused rows (`DecoderModel.load_weights`):
layer norms that a family names differently from us (`FamilySpec.weight_renames`), expert weights
(stacked per layer: `moe.stack_expert_weights`), and the rotary layout. GLM-4 rotates interleaved pairs (x0, x1), (x2, x3), ... where we rotate halves
(x_i, x_{i + R/2}). Attention only ever takes q . k, which any permutation of the head's dims applied
to both q and k leaves unchanged, so the q and k rows of each head are regrouped at load into halves
order: one rotary kernel serves both layouts and nothing is permuted at run time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from inference_service.cpu_kernels.quant import QuantizedWeight
from inference_service.model.config import ModelConfig
from inference_service.model.family import FamilySpec
from inference_service.model.moe import stack_expert_weights


def interleaved_to_halves(num_heads: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Row order [num_heads * head_dim] int64 that turns each head's interleaved rotary rows
    (0, 1, 2, 3, ... of its first `rotary_dim`) into halves order (0, 2, 4, ..., 1, 3, 5, ...); the
    head's other rows stay in place."""
    within = torch.arange(head_dim)
    within[:rotary_dim] = torch.cat((torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)))
    return (torch.arange(num_heads)[:, None] * head_dim + within[None, :]).reshape(-1)


def family_weights(spec: FamilySpec, config: ModelConfig,
                   weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
                   ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's (name, tensor) pairs renamed and re-laid out for our decoder."""
    orders = {}
    if spec.rope_layout == "interleaved":
        orders = {"self_attn.q_proj.": interleaved_to_halves(config.num_attention_heads, config.head_dim,
                                                             config.rotary_dim),
                  "self_attn.k_proj.": interleaved_to_halves(config.num_key_value_heads, config.head_dim,
                                                             config.rotary_dim)}
    weights = _renamed(spec, weights)
    if config.num_experts:
        weights = stack_expert_weights(config, weights)  # after the renames: Mixtral's experts are under mlp. then
    for name, tensor in weights:
        for part, order in orders.items():
            if f".{part}" in name:
                if isinstance(tensor, QuantizedWeight):
                    tensor = tensor.select_rows(order.numpy())
                elif isinstance(tensor, torch.Tensor):
                    tensor = tensor.index_select(0, order)
                else:  # a GPU-packed weight (model/quant/)
                    from inference_service.model.quant.rows import select_rows

                    tensor = select_rows(tensor, order)
                break
        yield name, tensor


def _renamed(spec: FamilySpec, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
             ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    for name, tensor in weights:
        for old, new in spec.weight_renames:
            if f".{old}" in name:
                name = name.replace(f".{old}", f".{new}", 1)
                break
        yield name, tensor
