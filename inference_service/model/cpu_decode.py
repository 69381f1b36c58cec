"""Steps of a GGUF model on the CPU, one C++ call per layer (`cpu_kernels/decoder_layer.cpp`).

At batch 1 the embedded model's layer streams ~2 MB of packed weights, and the torch calls around its
matmuls cost about as much again in dispatch; `CpuDecodeLayers` runs a whole layer's step in one call over
the same kernels in the same order as the eager layer, so a decode step's logits are the eager path's bit for
bit (a prompt's rows attend through the decode kernel instead of SDPA: the same up to summation order).
It takes the plain Llama-family layer (RMSNorm, full-head RoPE, gated MLP, every projection in GGUF
blocks, float32) and every step whose quantized matmuls run in blocks (`expands_for`: any step where the CPU
has AMX, up to 48 tokens elsewhere); anything else runs the eager layers.

A step with prompt tokens (a prompt, or a mixed step of decodes and a prompt's chunk) runs as one row a token:
token t of a sequence is a query over the sequence's first t + 1 positions (its own block table, a context
length of its position + 1), which the decode attention computes as causal attention does, after the call has
written every row's key and value (with AVX-512, up to 16 consecutive rows of a sequence attend as one tile that
reads each key and value once). Eagerly, 15 decodes and an 11-token prompt took ~51 ms against ~22 for 16
decodes (2-core CPU, 2026-11-27), most of it the torch ops' dispatch and two thread pools between them. The C++
layers stay ahead of the eager ones (one SDPA a prompt) however long the step, where AMX runs the matmuls
(2-core Xeon, 2026-11-27, a prompt alone in its step: 128 tokens 89 against 115 ms, 512 tokens 331-346 against
490-505, 2,048 tokens 2.0-2.1 s against 7.4-7.5, 4,096 tokens 7.4 s against 28.5).
"""

from __future__ import annotations

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.cpu_kernels.quant import load_extension
from inference_service.model.gguf_linear import GGUFLinear, expands_for
from inference_service.model.norms import RMSNorm


def _parts(linear: GGUFLinear) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]] | None:
    """The projection's GGUF row blocks as the C++ layer takes them; None if any of it is dense."""
    if not getattr(linear, "quantized", None) or sum(w.shape[0] for _, w in linear.quantized) != linear.out_features:
        return None
    return [(w.qs, w.scales, w.mins, int(w.qtype), first) for first, w in linear.quantized]


class CpuDecodeLayers:
    """The model's layers as C++ decode layers; `build` says None where the model does not qualify."""

    def __init__(self, layers: list, rotary) -> None:
        self._layers = layers
        self._rotary = rotary

    @classmethod
    def build(cls, model) -> CpuDecodeLayers | None:
        """C++ layers for a loaded `DecoderModel` whose every layer qualifies (see the module doc)."""
        config, spec = model.config, model.spec
        ext = load_extension() if model.device.type == "cpu" and model.dtype == torch.float32 else None
        if (ext is None or getattr(model, "fused_kernels", False) or spec.qk_norm or spec.post_norms
                or config.num_experts  # mixture-of-experts MLPs have no C++ layer
                or not getattr(model.attention_backend, "use_cpu_kernels", False)
                or spec.attn_soft_cap is not None or config.rotary_dim != config.head_dim
                or model.stack.local_rotary is not model.stack.rotary or model.stack.rotary.long_tables is not None
                or config.hidden_act not in ("silu", "gelu_pytorch_tanh")):
            return None
        layers = []
        for index, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            parts = [_parts(linear) for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (any(p is None for p in parts) or config.layer_window(index) is not None
                    or not all(type(norm) is RMSNorm for norm in norms)):
                return None
            qkv, o, gate_up, down = parts
            layers.append(ext.CpuDecoderLayer(
                qkv, attn.qkv_proj.bias, o, attn.o_proj.bias, gate_up, down,
                norms[0].scale.contiguous(), norms[1].scale.contiguous(), config.rms_norm_eps,
                attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate_size, attn.scale, mlp.is_gelu))
        return cls(layers, model.stack.rotary)

    @staticmethod
    def takes(num_tokens: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether a step of `num_tokens` runs in the C++ layers: when its quantized matmuls run in blocks (not
        expanded to dense BLAS), over a float32 or float16 cache."""
        return not expands_for(num_tokens) and kv_caches[0][0].dtype in (torch.float32, torch.float16)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata) -> torch.Tensor:
        """hidden [T, H] (the embedded tokens; the residual stream, updated in place) -> hidden [T, H]
        before the final norm."""
        cos, sin_signed = self._rotary.lookup(positions)  # [T, 1, D] each, shared by every layer
        block_tables, seq_lens, slots = metadata.block_tables, metadata.seq_lens, metadata.slot_mapping
        if hidden.shape[0] != seq_lens.shape[0]:  # prompt tokens: one query row a token (see the module doc)
            starts = metadata.query_start_loc_cpu
            row_seq = torch.repeat_interleave(torch.arange(len(starts) - 1), torch.tensor(starts).diff())
            if row_seq.shape[0] < hidden.shape[0]:  # trailing padding rows (slot -1): their own position
                row_seq = torch.cat([row_seq, row_seq.new_zeros(hidden.shape[0] - row_seq.shape[0])])
            block_tables = block_tables.index_select(0, row_seq)  # [T, max_blocks]
            seq_lens = (positions + 1).to(torch.int32)  # [T]
        for layer, (k_cache, v_cache) in zip(self._layers, kv_caches, strict=True):
            layer.forward(hidden, cos, sin_signed, k_cache, v_cache, block_tables, seq_lens, slots)
        return hidden
