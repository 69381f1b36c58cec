"""The decoder's layers on the fused Triton kernels of `kernels/`: the GPU path.

Same parameters (and so the same weight loading) as the eager layers of `decoder.py`; only the
forward passes differ. Per layer, the element-wise work is four launches (five with Qwen3's q/k norm):

    fused_add_rms_norm   residual += hidden; hidden = rms_norm(residual)   (first layer: rms_norm only)
    apply_rotary         q and k in place, as views of the fused qkv output
    fused_add_rms_norm   residual += attention output; normed for the MLP
    silu_and_mul         silu(gate) * up

The residual stream is kept apart from the hidden states, as in vLLM: a layer takes and returns
(hidden, residual), and the model's final norm adds the last layer's output into the residual.

Decode batches of up to `kernels.MAX_GEMV_ROWS` rows in bf16/fp16 take a shorter path: every
projection is `kernels.gemv`, with the RMSNorm computed in the qkv and gate_up projections' prologue,
the SiLU gate in the down projection's, and the residual adds in the o and down projections'
epilogues. A layer then launches qkv, rotary, attention, o, gate_up and down (plus the KV write).

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
from inference_service.model.rope import kernel_cos_sin_cache


class TritonRotary:
    """The [max_positions, head_dim] `[cos | sin] * attention_factor` table `kernels.apply_rotary` reads
    (`rope.kernel_cos_sin_cache`: every rope type and llama.cpp's frequency factors, as on the eager path)."""

    def __init__(self, config: ModelConfig, device: torch.device | str):
        self.cos_sin_cache = kernel_cos_sin_cache(config, device)  # [P, D] float32

    def apply_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (strided views allowed); positions [T]."""
        kernels.apply_rotary(q, k, positions, self.cos_sin_cache, is_neox=True)


def uses_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a projection of `x` [T, in] runs `kernels.gemv`: a decode batch of a few rows in
    bf16/fp16, where it streams the weight 9-23% faster than cuBLAS (H100) and takes the norm,
    gate and residual add along. fp32 keeps the library matmul and the separate element-wise
    kernels: it is the reference-precision path, compared token for token with the CPU engine."""
    return x.shape[0] <= kernels.MAX_GEMV_ROWS and weight.dtype in (torch.bfloat16, torch.float16)


def skinny_linear(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` ([T, in] -> [T, out]), through `kernels.gemv` where `uses_gemv`."""
    return kernels.gemv(x, layer.weight, layer.bias) if uses_gemv(x, layer.weight) else layer(x)


class FusedRMSNorm(RMSNorm):
    """RMSNorm fused with the residual add before it, in fp32 and rounded once."""

    def forward(self, hidden: torch.Tensor | None, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed [T, H], residual [T, H]). With no residual yet, `hidden` becomes the residual stream;
        with no hidden, `residual` is the whole stream; otherwise `residual += hidden` in place and
        the normed rows are written over `hidden`."""
        if hidden is None:
            return kernels.rms_norm(residual, self.weight, self.eps), residual
        if residual is None:
            return kernels.rms_norm(hidden, self.weight, self.eps), hidden
        return kernels.fused_add_rms_norm(hidden, residual, self.weight, self.eps), residual


class FusedAttention(Attention):
    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), positions, kv_cache, metadata))

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
               metadata: AttentionMetadata) -> torch.Tensor:
        """qkv [T, q + 2 kv] (the fused projection's output) -> attention output [T, q], before o_proj."""
        num_tokens = qkv.shape[0]
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
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale,
                                   sliding_window=self.sliding_window, soft_cap=self.soft_cap)  # [T, Hq, D]
        return out.reshape(num_tokens, self.q_size)


class FusedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))  # [T, 2 I] -> [T, I] -> [T, H]


class FusedDecoderLayer(DecoderLayer):
    norm_cls, attention_cls, mlp_cls = FusedRMSNorm, FusedAttention, FusedMLP

    def forward(self, hidden: torch.Tensor | None, residual: torch.Tensor | None, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                metadata: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(hidden, residual) [T, H] each -> this layer's MLP output and the residual before it is added.

        A decode batch that `uses_gemv` returns (None, stream) instead: the residual adds are done
        by the o and down projections, so the stream already holds the MLP output."""
        if uses_gemv(residual if hidden is None else hidden, self.mlp.down_proj.weight):
            return None, self._forward_gemv(hidden, residual, positions, kv_cache, metadata)
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, positions, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def _forward_gemv(self, hidden: torch.Tensor | None, residual: torch.Tensor | None, positions: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        """Four skinny matmuls carry the layer's element-wise work along (no norm or SiLU launches):
        qkv = norm(stream) Wqkv (+ b), stream += attn Wo, stream += silu_mul(norm(stream) Wgu) Wd."""
        if hidden is None:
            stream = residual  # [T, H], holding every earlier layer's output
        else:
            stream = hidden if residual is None else hidden + residual  # the first layer: the embeddings
        attn, mlp = self.self_attn, self.mlp
        qkv = kernels.gemv(stream, attn.qkv_proj.weight, attn.qkv_proj.bias,
                           norm_weight=self.input_layernorm.weight, eps=self.input_layernorm.eps)  # [T, q + 2 kv]
        out = attn.attend(qkv, positions, kv_cache, metadata)  # [T, q]
        stream = kernels.gemv(out, attn.o_proj.weight, residual=stream)
        gate_up = kernels.gemv(stream, mlp.gate_up_proj.weight, norm_weight=self.post_attention_layernorm.weight,
                               eps=self.post_attention_layernorm.eps)  # [T, 2 I]
        return kernels.gemv(gate_up, mlp.down_proj.weight, gated=True, residual=stream)  # [T, H]
