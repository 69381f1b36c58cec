"""One decoder-only transformer for every family we serve: Llama (and Yi), Mistral, Qwen2, Qwen3,
Gemma 2 / 3, Phi-3 / Phi-4, StableLM and GLM-4.

The families differ in a few switches (`FamilySpec`, `family.py`): biases, q/k norms, the norm kind
and its (1 + w) offset, norms after attention and MLP, the MLP's activation, embedding scaling, soft
caps on attention scores and logits, sliding-window layers, partial and interleaved rotary.
Everything else — residual blocks, grouped-query attention with RoPE, a gated MLP — is shared.

Parameters keep Hugging Face's names, except that q/k/v and gate/up are fused at load time into
`qkv_proj` and `gate_up_proj` (one matmul each on the decode path); `load_weights` maps HF names onto
the fused rows (checkpoints that fuse them already, like Phi-3, load as they are).

The layers here are the eager path, tuned for the CPU. On a GPU the model runs the same parameters
through the fused Triton kernels instead (`fused_layers.py`, chosen by `DecoderModel(fused_kernels=)`);
a family feature those do not implement yet is refused there by name (`FamilySpec.fused_path_gaps`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.attention.backend import AttentionBackend, get_attention_backend
from inference_service.attention.metadata import AttentionMetadata
from inference_service.cpu_kernels.quant import QuantizedWeight, dequantize_rows
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig
from inference_service.model.family import FamilySpec
from inference_service.model.linear import Linear
from inference_service.model.norms import LayerNorm, RMSNorm, _param
from inference_service.model.rope import RotaryEmbedding
from inference_service.model.weights import family_weights

if TYPE_CHECKING:
    from inference_service.model.fused_layers import TritonRotary

__all__ = ["MLP", "Attention", "DecoderLayer", "DecoderModel", "FamilySpec", "LayerNorm", "RMSNorm"]


def make_norm(spec: FamilySpec, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str
              ) -> RMSNorm | LayerNorm:
    cls = LayerNorm if spec.norm_kind == "layer" else RMSNorm
    return cls(dim, eps, dtype, device, offset=spec.norm_offset)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: FamilySpec, backend: AttentionBackend,
                 rotary: RotaryEmbedding | TritonRotary, dtype: torch.dtype, device: torch.device | str,
                 layer_idx: int = 0):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = spec.attn_scale or self.head_dim ** -0.5
        self.sliding_window = config.layer_window(layer_idx)
        self.soft_cap = spec.attn_soft_cap
        self.backend, self.rotary = backend, rotary
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, config.hidden_size, spec.o_bias, dtype, device)
        self.q_norm = make_norm(spec, self.head_dim, config.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.k_norm = make_norm(spec, self.head_dim, config.rms_norm_eps, dtype, device) if spec.qk_norm else None

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
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], metadata, self.scale,
                                   sliding_window=self.sliding_window, soft_cap=self.soft_cap)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.is_gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, dtype, device)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]
        gate = gate_up[:, :self.intermediate_size]
        act = F.gelu(gate, approximate="tanh") if self.is_gelu else F.silu(gate)
        h = act.mul_(gate_up[:, self.intermediate_size:])  # [T, I]
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    """A pre-norm residual block; with `spec.post_norms` the attention and MLP outputs are normed too
    before they join the residual stream (Gemma 2/3, GLM-4)::

        h += post_self_attn_layernorm(attn(input_layernorm(h)))
        h += post_mlp_layernorm(mlp(post_attention_layernorm(h)))
    """

    norm_cls, attention_cls, mlp_cls = RMSNorm, Attention, MLP  # swapped by the fused layer

    def __init__(self, config: ModelConfig, spec: FamilySpec, backend: AttentionBackend,
                 rotary: RotaryEmbedding | TritonRotary, dtype: torch.dtype, device: torch.device | str,
                 layer_idx: int = 0):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        norm = self.norm_cls if self.norm_cls is not RMSNorm else (lambda *a: make_norm(spec, *a))
        self.input_layernorm = norm(hidden, eps, dtype, device)
        self.self_attn = self.attention_cls(config, spec, backend, rotary, dtype, device, layer_idx)
        self.post_attention_layernorm = norm(hidden, eps, dtype, device)
        self.mlp = self.mlp_cls(config, dtype, device)
        self.post_self_attn_layernorm = norm(hidden, eps, dtype, device) if spec.post_norms else None
        self.post_mlp_layernorm = norm(hidden, eps, dtype, device) if spec.post_norms else None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        # `hidden` is the residual stream [T, H]; both sub-blocks add into it in place.
        attn_out = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        if self.post_self_attn_layernorm is None:
            hidden.add_(self.mlp(self.post_attention_layernorm(hidden, add=attn_out)))
            return hidden
        attn_out = self.post_self_attn_layernorm(attn_out)
        mlp_out = self.mlp(self.post_attention_layernorm(hidden, add=attn_out))
        hidden.add_(self.post_mlp_layernorm(mlp_out))
        return hidden


class DecoderModel(nn.Module):
    """The model the engine runs: `forward` to hidden states, `compute_logits` for the rows it samples.

    `fused_kernels` picks the fused Triton layers (`fused_layers.py`) over the eager ones; None means
    on for CUDA devices. Both paths take the same weights and give the same results (fp32: to rounding).
    A family feature the fused layers lack is an `UnsupportedModelError` naming it."""

    def __init__(self, config: ModelConfig, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, attention_backend: AttentionBackend | None = None,
                 fused_kernels: bool | None = None):
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.spec = FamilySpec.from_config(config)
        self.attention_backend = attention_backend or get_attention_backend(device)
        self.fused_kernels = self.device.type == "cuda" if fused_kernels is None else fused_kernels
        if self.fused_kernels:
            gaps = self.spec.fused_path_gaps(config)
            if gaps:
                raise UnsupportedModelError(
                    f"{config.architecture} needs {', '.join(gaps)}, which the fused GPU layers do not "
                    f"implement yet")
            from inference_service.model import fused_layers  # noqa: PLC0415 - Triton only on this path

            layer_cls, norm_cls = fused_layers.FusedDecoderLayer, fused_layers.FusedRMSNorm
            self.rotary = fused_layers.TritonRotary(config, device)
            self.local_rotary = self.rotary
            self._project = fused_layers.skinny_linear
        else:
            layer_cls, norm_cls = DecoderLayer, None
            self.rotary = RotaryEmbedding(config, device=device, dtype=dtype)
            # Gemma 3's sliding layers rotate with a base of their own, unscaled.
            self.local_rotary = self.rotary if config.rope_local_theta is None else RotaryEmbedding(
                replace(config, rope_theta=config.rope_local_theta, rope_scaling=None, rope_freq_factors=None),
                device=device, dtype=dtype)
            self._project = Linear.__call__  # (layer, x) -> layer(x)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        self.model.embed_tokens.weight = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # The embedding kept in GGUF blocks (CPU): rows are expanded as they are looked up.
        self.quantized_embedding: QuantizedWeight | None = None
        # Which layers read the local rotary table (those that slide, when there are two tables).
        self._is_local = [self.local_rotary is not self.rotary and config.layer_window(i) is not None
                          for i in range(config.num_hidden_layers)]
        self.model.layers = nn.ModuleList(
            layer_cls(config, self.spec, self.attention_backend,
                      self.local_rotary if self._is_local[i] else self.rotary, dtype, device, i)
            for i in range(config.num_hidden_layers)
        )
        eps = config.rms_norm_eps
        self.model.norm = norm_cls(config.hidden_size, eps, dtype, device) if norm_cls else make_norm(
            self.spec, config.hidden_size, eps, dtype, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # HF multiplies in the model dtype: sqrt(H) rounded to it first.
        self._embedding_scale = None if self.spec.embedding_scale is None else torch.tensor(
            self.spec.embedding_scale, dtype=dtype, device=device)
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
        if self._embedding_scale is not None:
            hidden.mul_(self._embedding_scale)
        if self.fused_kernels:
            residual = None
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                hidden, residual = layer(hidden, residual, positions, kv_cache, attn_metadata)
            return self.model.norm(hidden, residual)[0]
        use_long = self._uses_long_rope(positions, attn_metadata)
        tables = {False: self.rotary.lookup(positions, use_long)}  # [T, 1, R] each, shared by every layer
        if self.local_rotary is not self.rotary:
            tables[True] = self.local_rotary.lookup(positions, use_long)
        for layer, kv_cache, is_local in zip(self.model.layers, kv_caches, self._is_local, strict=True):
            hidden = layer(hidden, *tables[is_local], kv_cache, attn_metadata)
        return self.model.norm(hidden)

    def _uses_long_rope(self, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor | None:
        """[T] bool: the token's sequence has more context than LongRoPE's original length (HF picks
        the long factors per forward by that length); None without LongRoPE."""
        original = self.rotary.original_max_positions
        if original is None:
            return None
        query_lens = metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]
        per_token = torch.repeat_interleave(metadata.seq_lens.long() > original, query_lens.long())
        if per_token.shape[0] < positions.shape[0]:  # padding rows past the last sequence
            per_token = F.pad(per_token, (0, positions.shape[0] - per_token.shape[0]))
        return per_token.to(positions.device)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32 (soft-capped where the family caps them)."""
        logits = self._project(self.lm_head, hidden).float()
        cap = self.spec.final_soft_cap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

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
            for name, tensor in family_weights(self.spec, self.config, weights):
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
        self.finish_loading()

    def finish_loading(self) -> None:
        """Derive what the loaded weights imply (norm scales with their offset, packed projections);
        after `load_weights` or any other filling of the parameters."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, LayerNorm)):
                module.prepare()
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
