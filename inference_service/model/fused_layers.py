"""The decoder's layers on the fused Triton kernels of `kernels/`: the GPU path.

Same parameters (and so the same weight loading) as the eager layers of `decoder.py`; only the
forward passes differ. Per layer, the element-wise work is four launches (five with Qwen3's q/k norm):

    fused_add_rms_norm   residual += hidden; hidden = rms_norm(residual)   (first layer: rms_norm only)
    apply_rotary         q and k in place, as views of the fused qkv output
    fused_add_rms_norm   residual += attention output; normed for the MLP
    silu_and_mul         silu(gate) * up

The residual stream is kept apart from the hidden states, as in vLLM: a layer takes and returns
(hidden, residual), and the model's final norm adds the last layer's output into the residual.

Every step is CUDA-graph capturable: no host syncs and no branches on tensor values. This module
imports Triton; `DecoderModel` imports it only when its fused path is chosen.
"""

from __future__ import annotations

import torch

import kernels
from inference_service.attention.metadata import AttentionMetadata
from inference_service.model.config import ModelConfig
from inference_service.model.decoder import MLP, Attention, DecoderLayer, RMSNorm
from inference_service.model.linear import Linear
from inference_service.model.rope import compute_inv_freq


class TritonRotary:
    """The [max_positions, head_dim] `[cos | sin] * attention_factor` table `kernels.apply_rotary` reads.

    Built from our own `compute_inv_freq` (so every rope type and llama.cpp's frequency factors
    apply as on the eager path), in fp32: the kernel rotates in fp32 and rounds once to q's dtype."""

    def __init__(self, config: ModelConfig, device: torch.device | str):
        inv_freq, attention_factor = compute_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], the same products as RotaryEmbedding's
        self.cos_sin_cache = (torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor).to(device)  # [P, D]

    def apply_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (strided views allowed); positions [T]."""
        kernels.apply_rotary(q, k, positions, self.cos_sin_cache, is_neox=True)


def skinny_linear(layer: Linear, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """`layer(x)` ([T, in] -> [T, out]); with `gated`, x is [T, 2 * in] = [gate | up] and the layer
    projects silu(gate) * up.

    A decode batch of a few rows in bf16/fp16 runs `kernels.gemv`, which streams the weight ~10-20%
    faster than cuBLAS at one row (H100) and fuses the gate. fp32 keeps the library matmul: it is the
    reference-precision path, compared token for token with the CPU engine."""
    if x.shape[0] <= kernels.MAX_GEMV_ROWS and layer.weight.dtype in (torch.bfloat16, torch.float16):
        return kernels.gemv(x, layer.weight, layer.bias, gated=gated)
    return layer(kernels.silu_and_mul(x) if gated else x)


class FusedRMSNorm(RMSNorm):
    """RMSNorm fused with the residual add before it, in fp32 and rounded once."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed [T, H], residual [T, H]). With no residual yet, `hidden` becomes the residual stream;
        otherwise `residual += hidden` in place and the normed rows are written over `hidden`."""
        if residual is None:
            return kernels.rms_norm(hidden, self.weight, self.eps), hidden
        return kernels.fused_add_rms_norm(hidden, residual, self.weight, self.eps), residual


class FusedAttention(Attention):
    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = skinny_linear(self.qkv_proj, x)  # [T, q + 2 kv]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        if self.q_norm is None:
            q = qkv[:, :q_end].view(num_tokens, self.num_heads, self.head_dim)  # views of qkv, rotated in place
            k = qkv[:, q_end:k_end].view(num_tokens, self.num_kv_heads, self.head_dim)
        else:
            # NOTE: the norm kernel takes rows of one stride, and a head-row of q inside qkv has two
            # (next head, next token), so q and k are copied out (a view when T == 1) and normed in place.
            q = qkv[:, :q_end].reshape(num_tokens * self.num_heads, self.head_dim)
            k = qkv[:, q_end:k_end].reshape(num_tokens * self.num_kv_heads, self.head_dim)
            kernels.rms_norm(q, self.q_norm.weight, self.q_norm.eps, out=q)
            kernels.rms_norm(k, self.k_norm.weight, self.k_norm.eps, out=k)
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        self.rotary.apply_(q, k, positions)
        v = qkv[:, k_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)  # [T, Hq, D]
        return skinny_linear(self.o_proj, out.reshape(num_tokens, self.q_size))


class FusedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(self.down_proj, skinny_linear(self.gate_up_proj, x), gated=True)  # [T, 2 I] -> [T, H]


class FusedDecoderLayer(DecoderLayer):
    norm_cls, attention_cls, mlp_cls = FusedRMSNorm, FusedAttention, FusedMLP

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [T, H] each -> this layer's MLP output and the residual before it is added."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual
