"""The eager decoder stack: the layers of `layers.py` run in torch and the C++ CPU kernels.

The CPU default, and the GPU path for family features the fused stack lacks (no host syncs on a
decode step, so CUDA graphs capture it). Each layer is a
pre-norm residual block whose sub-blocks add into the residual stream in place (see
`layers.DecoderLayer`); the rotary tables are looked up once a step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.attention.backend import AttentionBackend
from inference_service.attention.metadata import AttentionMetadata
from inference_service.model.config import ModelConfig
from inference_service.model.layers import MLP, Attention, DecoderLayer
from inference_service.model.moe import SparseMoE, moe_forward
from inference_service.model.norms import LayerNorm, RMSNorm
from inference_service.model.rope import RotaryEmbedding


class EagerStack:
    """`forward(hidden, positions, kv_caches, metadata) -> hidden` over `layers`, and the final norm."""

    def __init__(self, config: ModelConfig, layers: nn.ModuleList, norm: RMSNorm | LayerNorm,
                 backend: AttentionBackend, dtype: torch.dtype, device: torch.device | str):
        self.layers, self.norm, self.backend = layers, norm, backend
        self.rotary = RotaryEmbedding(config, device=device, dtype=dtype)
        # Gemma 3's sliding layers rotate with a base of their own, unscaled.
        self.local_rotary = self.rotary if config.rope_local_theta is None else RotaryEmbedding(
            replace(config, rope_theta=config.rope_local_theta, rope_scaling=None, rope_freq_factors=None),
            device=device, dtype=dtype)
        # Which layers read the local rotary table (those that slide, when there are two tables).
        self.is_local = [self.local_rotary is not self.rotary and config.layer_window(i) is not None
                         for i in range(config.num_hidden_layers)]
        # Decode steps layer by layer in C++ (`cpu_decode.CpuDecodeLayers`), set by the model once its
        # weights are loaded where they qualify; None runs every step here.
        self.cpu_decode_layers = None

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata) -> torch.Tensor:
        """hidden [T, H] embeddings (a fresh buffer, used as the residual stream) -> the stream after
        the last layer [T, H]."""
        fast = self.cpu_decode_layers
        if fast is not None and fast.takes(hidden.shape[0], kv_caches):
            return fast.forward(hidden, positions, kv_caches, metadata)
        use_long = self._uses_long_rope(positions, metadata)
        tables = {False: self.rotary.lookup(positions, use_long)}  # [T, 1, R] each, shared by every layer
        if self.local_rotary is not self.rotary:
            tables[True] = self.local_rotary.lookup(positions, use_long)
        for layer, kv_cache, is_local in zip(self.layers, kv_caches, self.is_local, strict=True):
            hidden = self._layer(layer, hidden, *tables[is_local], kv_cache, metadata)
        return hidden

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final norm of the stream [T, H]."""
        return self.norm(hidden)

    def _layer(self, layer: DecoderLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        # `hidden` is the residual stream [T, H]; both sub-blocks add into it in place.
        attn_out = self._attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        if layer.post_self_attn_layernorm is None:
            hidden.add_(self._mlp(layer.mlp, layer.post_attention_layernorm(hidden, add=attn_out)))
            return hidden
        attn_out = layer.post_self_attn_layernorm(attn_out)
        mlp_out = self._mlp(layer.mlp, layer.post_attention_layernorm(hidden, add=attn_out))
        hidden.add_(layer.post_mlp_layernorm(mlp_out))
        return hidden

    def _attention(self, attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens, q_size, kv_size = x.shape[0], attn.q_size, attn.kv_size
        qkv = attn.qkv_proj(x)  # [T, q + 2 kv]
        v = qkv[:, q_size + kv_size:].view(num_tokens, attn.num_kv_heads, attn.head_dim)
        # NOTE: the local and global tables differ only in their values (`cos`, `sin`), not in how
        # they rotate, so either applies them.
        rotary = self.rotary
        if attn.q_norm is None:
            # q and k sit side by side in qkv: rotate both heads' worth in one pass, in place.
            qk = qkv[:, :q_size + kv_size].view(num_tokens, attn.num_heads + attn.num_kv_heads,
                                               attn.head_dim)  # [T, Hq + Hkv, D]
            rotary.apply_(qk, cos, sin)
            q, k = qk[:, :attn.num_heads], qk[:, attn.num_heads:]
        else:
            q = attn.q_norm(qkv[:, :q_size].view(num_tokens, attn.num_heads, attn.head_dim))
            k = attn.k_norm(qkv[:, q_size:q_size + kv_size].view(num_tokens, attn.num_kv_heads, attn.head_dim))
            rotary.apply_(q, cos, sin)
            rotary.apply_(k, cos, sin)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, attn.scale,
                                   sliding_window=attn.sliding_window, soft_cap=attn.soft_cap)  # [T, Hq, D]
        return attn.o_proj(out.reshape(num_tokens, q_size))

    @staticmethod
    def _mlp(mlp: MLP | SparseMoE, x: torch.Tensor) -> torch.Tensor:
        if isinstance(mlp, SparseMoE):
            return moe_forward(mlp, x)
        gate_up = mlp.gate_up_proj(x)  # [T, 2 I]
        gate = gate_up[:, :mlp.intermediate_size]
        act = F.gelu(gate, approximate="tanh") if mlp.is_gelu else F.silu(gate)
        h = act.mul_(gate_up[:, mlp.intermediate_size:])  # [T, I]
        return mlp.down_proj(h)

    def _uses_long_rope(self, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor | None:
        """[T] bool: the token's sequence has more context than LongRoPE's original length (HF picks
        the long factors per forward by that length); None without LongRoPE."""
        original = self.rotary.original_max_positions
        if original is None:
            return None
        # NOTE: each token's sequence found by searching the query starts, not `repeat_interleave` by
        # query lengths, which needs its output size on the host: this way a CUDA graph can capture it.
        # Padding rows past the last sequence take the last one's flag; their outputs are never read.
        starts = metadata.query_start_loc[1:].to(positions.device)
        token_rows = torch.arange(positions.shape[0], device=positions.device)
        seq_index = torch.searchsorted(starts, token_rows, right=True).clamp_(max=starts.shape[0] - 1)
        return (metadata.seq_lens.to(positions.device).long() > original)[seq_index]
