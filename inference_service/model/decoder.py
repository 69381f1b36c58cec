"""One decoder-only transformer for Llama, Mistral, Qwen2 and Qwen3.

The families differ in two switches (`FamilySpec`): biases on the q/k/v projection (Qwen2) and an
RMSNorm over each head of q and k before RoPE (Qwen3). Everything else — pre-norm residual blocks,
grouped-query attention with rotate-half RoPE, a SiLU-gated MLP — is shared.

Parameters keep Hugging Face's names, except that q/k/v and gate/up are fused at load time into
`qkv_proj` and `gate_up_proj` (one matmul each on the decode path); `load_weights` maps HF names onto
the fused rows.

The layers here are the eager path, tuned for the CPU. On a GPU the model runs the same parameters
through the fused Triton kernels instead (`fused_layers.py`, chosen by `DecoderModel(fused_kernels=)`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.attention.backend import AttentionBackend, get_attention_backend
from inference_service.attention.metadata import AttentionMetadata
from inference_service.cpu_kernels.quant import QuantizedWeight, cpu_ops_for, dequantize_rows
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig
from inference_service.model.linear import Linear
from inference_service.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from inference_service.model.fused_layers import TritonRotary


@dataclass(frozen=True)
class FamilySpec:
    """What sets one model family apart from the shared decoder."""

    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def from_config(cls, config: ModelConfig) -> FamilySpec:
        return cls(qkv_bias=config.attention_bias, qk_norm=config.use_qk_norm)


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """weight * x / rms(x), over the last dimension (same rounding as HF's LlamaRMSNorm in fp32)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps
        self.shape = (dim,)
        self._cpu_ops = cpu_ops_for(self.weight)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> normed [..., H]. With `add`, x += add in place first (the residual stream)."""
        if self._cpu_ops is not None and x.dim() == 2 and x.is_contiguous():
            return self._cpu_ops.add_rms_norm(x, add, self.weight, self.eps)
        if add is not None:
            x.add_(add)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        # Lower precision: normalize in fp32 like HF, then scale in the model dtype.
        normed = F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
        return self.weight * normed


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: FamilySpec, backend: AttentionBackend,
                 rotary: RotaryEmbedding | TritonRotary, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim ** -0.5
        self.backend, self.rotary = backend, rotary
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, False, dtype, device)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k sit side by side in qkv: rotate both heads' worth in one pass, in place.
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads,
                                                         self.head_dim)  # [T, Hq + Hkv, D]
            self.rotary.apply_(qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(
                num_tokens, self.num_kv_heads, self.head_dim))
            self.rotary.apply_(q, cos, sin)
            self.rotary.apply_(k, cos, sin)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, device)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        h = F.silu(gate_up[:, :self.intermediate_size]).mul_(gate_up[:, self.intermediate_size:])  # [T, I]
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    norm_cls, attention_cls, mlp_cls = RMSNorm, Attention, MLP  # swapped by the fused layer

    def __init__(self, config: ModelConfig, spec: FamilySpec, backend: AttentionBackend,
                 rotary: RotaryEmbedding | TritonRotary, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.input_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = self.attention_cls(config, spec, backend, rotary, dtype, device)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = self.mlp_cls(config, dtype, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        # `hidden` is the residual stream [T, H]; both sub-blocks add into it in place.
        attn_out = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        hidden.add_(self.mlp(self.post_attention_layernorm(hidden, add=attn_out)))
        return hidden


class DecoderModel(nn.Module):
    """The model the engine runs: `forward` to hidden states, `compute_logits` for the rows it samples.

    `fused_kernels` picks the fused Triton layers (`fused_layers.py`) over the eager ones; None means
    on for CUDA devices. Both paths take the same weights and give the same results (fp32: to rounding)."""

    def __init__(self, config: ModelConfig, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, attention_backend: AttentionBackend | None = None,
                 fused_kernels: bool | None = None):
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.spec = FamilySpec.from_config(config)
        self.attention_backend = attention_backend or get_attention_backend(device)
        self.fused_kernels = self.device.type == "cuda" if fused_kernels is None else fused_kernels
        if self.fused_kernels:
            from inference_service.model import fused_layers  # noqa: PLC0415 - Triton only on this path

            layer_cls, norm_cls = fused_layers.FusedDecoderLayer, fused_layers.FusedRMSNorm
            self.rotary = fused_layers.TritonRotary(config, device)
            self._project = fused_layers.skinny_linear
        else:
            layer_cls, norm_cls = DecoderLayer, RMSNorm
            self.rotary = RotaryEmbedding(config, device=device, dtype=dtype)
            self._project = Linear.__call__  # (layer, x) -> layer(x)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # The embedding kept in GGUF blocks (CPU): rows are expanded as they are looked up.
        self.quantized_embedding: QuantizedWeight | None = None
        self.model.layers = nn.ModuleList(
            layer_cls(config, self.spec, self.attention_backend, self.rotary, dtype, device)
            for _ in range(config.num_hidden_layers)
        )
        self.model.norm = norm_cls(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.eval()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> final-normed hidden states [T, hidden_size].

        `kv_caches[i]` is layer i's (k_cache, v_cache), each [num_blocks, block_size, Hkv, head_dim]
        in the model dtype; this step's keys and values are written into them at
        `attn_metadata.slot_mapping`."""
        if self.quantized_embedding is not None:
            hidden = dequantize_rows(self.quantized_embedding, input_ids)  # [T, H], a fresh residual buffer
        else:
            hidden = self.model.embed_tokens.weight.index_select(0, input_ids)  # [T, H], a fresh residual buffer
        if self.fused_kernels:
            residual = None
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                hidden, residual = layer(hidden, residual, positions, kv_cache, attn_metadata)
            return self.model.norm(hidden, residual)[0]
        cos, sin = self.rotary.lookup(positions)  # [T, 1, D] each, shared by every layer
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata)
        return self.model.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32."""
        return self._project(self.lm_head, hidden).float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's k_cache (and v_cache)."""
        return (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy HF-named tensors into the (partly fused) parameters.

        A `QuantizedWeight` stays in its blocks: a projection's rows run through the quantized kernels
        and the embedding is expanded row by row at lookup (and serves a tied lm_head in its blocks).
        Every parameter must be covered; an unknown name or a wrong shape raises
        `UnsupportedModelError` naming the tensor."""
        params = dict(self.named_parameters(remove_duplicate=False))
        linears = {f"{name}.weight": module for name, module in self.named_modules() if isinstance(module, Linear)}
        fused = self._fused_rows()
        loaded_rows: dict[str, int] = {}
        with torch.no_grad():
            for name, tensor in weights:
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue  # tied: some checkpoints still store a copy
                target, rows = name, None
                for suffix, (fused_suffix, start, size) in fused.items():
                    if name.endswith(suffix):
                        target, rows = name[: -len(suffix)] + fused_suffix, (start, size)
                        break
                param = params.get(target)
                if param is None:
                    raise UnsupportedModelError(f"unexpected weight {name!r} for {self.config.architecture}")
                dest = param if rows is None else param.narrow(0, rows[0], rows[1])
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise UnsupportedModelError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                if not isinstance(tensor, QuantizedWeight):
                    dest.copy_(tensor)
                elif target == "model.embed_tokens.weight":
                    self._load_quantized_embedding(tensor)
                elif target in linears:
                    linears[target].load_quantized_rows(0 if rows is None else rows[0], tensor)
                else:
                    dest.copy_(dequantize_rows(tensor))
                loaded_rows[target] = loaded_rows.get(target, 0) + dest.shape[0]
        missing = [name for name, param in params.items()
                   if loaded_rows.get(name, 0) != param.shape[0] and not (
                       name == "lm_head.weight" and self.config.tie_word_embeddings)]
        if missing:
            raise UnsupportedModelError(f"checkpoint lacks weights: {', '.join(missing[:8])}")
        self._pack_linears()

    def _load_quantized_embedding(self, weight: QuantizedWeight) -> None:
        self.quantized_embedding = weight
        if self.config.tie_word_embeddings:
            self.lm_head.load_quantized_rows(0, weight)
        self.model.embed_tokens.weight.data = torch.empty(0, dtype=self.dtype, device=self.device)

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: every parameter (a tied embedding once, as the lm_head)
        and every quantized projection in its blocks."""
        params = {id(p): p.numel() * p.element_size() for p in self.parameters()}  # tied: counted once
        return sum(params.values()) + sum(m.num_packed_bytes for m in self.modules() if isinstance(m, Linear))

    def _pack_linears(self) -> None:
        """Re-lay every projection out for the CPU matmul kernels once the weights are in.

        NOTE: not on the fused path: its kernels read `weight` itself (the plain layout), and whether
        a CPU packs bf16 at all depends on its instruction set (avx512_bf16)."""
        if self.fused_kernels:
            return
        for module in self.modules():
            if isinstance(module, Linear):
                # The tied lm_head shares its weight with the embedding, which lookups still need.
                shares_embedding = (module is self.lm_head and self.config.tie_word_embeddings
                                    and self.quantized_embedding is None)
                module.pack(release_weight=not shares_embedding)

    def _fused_rows(self) -> dict[str, tuple[str, int, int]]:
        """HF parameter suffix -> (fused parameter suffix, first row, number of rows)."""
        q, kv, inter = self.config.q_size, self.config.kv_size, self.config.intermediate_size
        table = {}
        for kind in ("weight", "bias"):
            table[f"self_attn.q_proj.{kind}"] = (f"self_attn.qkv_proj.{kind}", 0, q)
            table[f"self_attn.k_proj.{kind}"] = (f"self_attn.qkv_proj.{kind}", q, kv)
            table[f"self_attn.v_proj.{kind}"] = (f"self_attn.qkv_proj.{kind}", q + kv, kv)
        table["mlp.gate_proj.weight"] = ("mlp.gate_up_proj.weight", 0, inter)
        table["mlp.up_proj.weight"] = ("mlp.gate_up_proj.weight", inter, inter)
        return table
