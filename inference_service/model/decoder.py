"""One decoder-only transformer for every family we serve: Llama (and Yi), Mistral, Qwen2, Qwen3,
Gemma 2 / 3, Phi-3 / Phi-4, StableLM and GLM-4.

The families differ in a few switches (`FamilySpec`, `family.py`): biases, q/k norms, the norm kind
and its (1 + w) offset, norms after attention and MLP, the MLP's activation, embedding scaling, soft
caps on attention scores and logits, sliding-window layers, partial and interleaved rotary.
Everything else — residual blocks, grouped-query attention with RoPE, a gated MLP — is shared.

`DecoderModel` is composed of three parts, each chosen once at construction:

    parameters   layers.py        HF-named modules with no forward, and the checkpoint-name mapping
    stack        eager_stack.py   torch and the C++ CPU kernels (the CPU default)
                 fused_stack.py   the fused Triton kernels (CUDA default); a family needing a feature
                                  it does not implement yet (`FamilySpec.fused_path_gaps`) runs the
                                  eager stack on CUDA instead
    projections  linear.py        one `LinearBase` interface: dense, GGUF blocks on the CPU
                                  (gguf_linear.py), gemv on the fused path, later quantized / sharded

and its forward wires them: embedding -> stack -> final norm; `compute_logits` -> lm_head.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from inference_service.attention.backend import AttentionBackend, get_attention_backend
from inference_service.attention.metadata import AttentionMetadata
from inference_service.cpu_kernels.quant import QuantizedWeight
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig
from inference_service.model.cpu_decode import CpuDecodeLayers
from inference_service.model.eager_stack import EagerStack
from inference_service.model.family import FamilySpec
from inference_service.model.gguf_linear import GGUFLinear
from inference_service.model.layers import DecoderBody, LinearFactory, load_weights
from inference_service.model.linear import LinearBase
from inference_service.model.norms import LayerNorm, RMSNorm

__all__ = ["DecoderModel", "FamilySpec"]

logger = logging.getLogger(__name__)


class DecoderModel(nn.Module):
    """The model the engine runs: `forward` to hidden states, `compute_logits` for the rows it samples.

    `fused_kernels` picks the fused Triton stack (`fused_stack.py`) over the eager one; None means
    on for CUDA devices, unless the family needs a feature the fused stack lacks
    (`FamilySpec.fused_path_gaps`): then the eager stack runs on CUDA (torch ops, the Triton attention
    backend, CUDA graphs), logged with the gaps. Both stacks take the same weights and give the same
    results (fp32: to rounding). `fused_kernels=True` with such a gap is an `UnsupportedModelError`
    naming it. `linear_cls`
    overrides the projections' `LinearBase` variant (default: `GemvLinear` on the fused stack, else
    `GGUFLinear`, which runs dense rows as `DenseLinear` does and GGUF blocks in place)."""

    def __init__(self, config: ModelConfig, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, attention_backend: AttentionBackend | None = None,
                 fused_kernels: bool | None = None, linear_cls: LinearFactory | None = None):
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.spec = FamilySpec.from_config(config)
        self.attention_backend = attention_backend or get_attention_backend(device)
        self.fused_kernels = self.device.type == "cuda" if fused_kernels is None else fused_kernels
        if self.fused_kernels:
            gaps = self.spec.fused_path_gaps(config)
            if gaps and fused_kernels is None:
                logger.warning("%s needs %s, which the fused GPU layers do not implement yet: running the "
                               "eager layers on %s", config.architecture, ", ".join(gaps), self.device)
                self.fused_kernels = False
            elif gaps:
                raise UnsupportedModelError(
                    f"{config.architecture} needs {', '.join(gaps)}, which the fused GPU layers do not "
                    f"implement yet")
            from inference_service.model import fused_stack  # noqa: PLC0415 - Triton only on this path

            stack_cls, linear_cls = fused_stack.FusedStack, linear_cls or fused_stack.GemvLinear
        else:
            stack_cls, linear_cls = EagerStack, linear_cls or GGUFLinear
        self.model = DecoderBody(config, self.spec, linear_cls, dtype, device)
        self.lm_head = linear_cls(config.hidden_size, config.vocab_size, False, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.tie_weight(self.model.embed_tokens.weight)
        self.stack = stack_cls(config, self.model.layers, self.model.norm, self.attention_backend, dtype, device)
        self.eval()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> final-normed hidden states [T, hidden_size].

        `kv_caches[i]` is layer i's (k_cache, v_cache), each [num_blocks, block_size, Hkv, head_dim]
        in the model dtype; this step's keys and values are written into them at
        `attn_metadata.slot_mapping`."""
        hidden = self.model.embed_tokens.lookup(input_ids)  # [T, H], a fresh residual buffer
        hidden = self.stack.forward(hidden, positions, kv_caches, attn_metadata)
        return self.stack.final_norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] float32 (soft-capped where the family caps them),
        written into `out` ([N, vocab_size] float32) when given: the lm_head's output widened in that one copy
        (at 384 rows of a 128k vocabulary a second copy was ~80 us of a decode step)."""
        logits = self.lm_head(hidden)
        logits = logits.float() if out is None else out.copy_(logits)
        cap = self.spec.final_soft_cap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's k_cache (and v_cache)."""
        return (num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)

    @property
    def quantized_embedding(self) -> QuantizedWeight | None:
        """The embedding in its GGUF blocks, when the checkpoint's was kept so (CPU)."""
        return self.model.embed_tokens.quantized

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy HF-named tensors into the (partly fused) parameters (`layers.load_weights`), then
        `finish_loading()`. An unknown name, a wrong shape or a missing tensor raises
        `UnsupportedModelError` naming it."""
        load_weights(self, self.spec, self.config, weights)
        self.finish_loading()

    def finish_loading(self) -> None:
        """Derive what the loaded weights imply (norm scales with their offset, each projection's
        `finish_loading`: packed or merged weights); after `load_weights` or any other filling of the
        parameters."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, LayerNorm)):
                module.prepare()
            elif isinstance(module, LinearBase):
                module.finish_loading()
        if isinstance(self.stack, EagerStack):
            self.stack.cpu_decode_layers = CpuDecodeLayers.build(self)

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of weights a decode step reads: every projection as it keeps its weight, and every
        other parameter (a tied embedding once, as the lm_head)."""
        linears = [m for m in self.modules() if isinstance(m, LinearBase)]
        counted = {id(p) for linear in linears for p in linear.parameters()}
        others = {id(p): p.numel() * p.element_size() for p in self.parameters() if id(p) not in counted}
        return sum(linear.num_weight_bytes() for linear in linears) + sum(others.values())
