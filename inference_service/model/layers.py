"""The decoder's parameters, and the checkpoint-name -> parameter mapping that fills them.

The modules here hold parameters and the numbers that describe them (head counts, window, scale);
none has a `forward`. Two stacks run them: `eager_stack.py` (torch and the C++ CPU kernels) and
`fused_stack.py` (Triton); each imports this file and neither imports the other. `DecoderModel`
(`decoder.py`) builds the parameters once and hands them to the stack it picks.

Names are Hugging Face's, so loading is a lookup, except that q/k/v and gate/up are one projection
each (`qkv_proj`, `gate_up_proj`: one matmul on the decode path). Those are a `LinearBase` with
`output_partitions` (q, k, v rows; gate, up rows), and `load_weights` sends a checkpoint's
`q_proj` / `k_proj` / ... rows to their partition (checkpoints that fuse them already, like Phi-3,
load as they are)::

    model.embed_tokens.weight                 Embedding          [vocab, H]
    model.layers.{i}.input_layernorm          RMSNorm / LayerNorm
    model.layers.{i}.self_attn.qkv_proj       Linear, partitions (q, kv, kv)   <- q_proj, k_proj, v_proj
    model.layers.{i}.self_attn.o_proj         Linear
    model.layers.{i}.self_attn.{q,k}_norm     (Qwen3, Gemma 3)
    model.layers.{i}.post_attention_layernorm
    model.layers.{i}.mlp.gate_up_proj         Linear, partitions (I, I)        <- gate_proj, up_proj
    model.layers.{i}.mlp.down_proj            Linear
    model.layers.{i}.mlp.{gate,experts}       a `SparseMoE` instead, in MoE layers (moe.py)
    model.layers.{i}.post_{self_attn,mlp}_layernorm   (Gemma 2/3, GLM-4)
    model.norm, lm_head                       (lm_head may share embed_tokens' weight)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from inference_service.cpu_kernels.quant import QuantizedWeight, dequantize_rows
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig
from inference_service.model.family import FamilySpec
from inference_service.model.linear import LinearBase
from inference_service.model.moe import SparseMoE
from inference_service.model.norms import LayerNorm, RMSNorm, _param
from inference_service.model.weights import family_weights

# (in_features, out_features, bias, dtype, device, output_partitions=...) -> a Linear variant.
LinearFactory = Callable[..., LinearBase]

# A checkpoint's separate projections -> (our fused projection, its partition).
_PARTITIONED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def make_norm(spec: FamilySpec, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str
              ) -> RMSNorm | LayerNorm:
    cls = LayerNorm if spec.norm_kind == "layer" else RMSNorm
    return cls(dim, eps, dtype, device, offset=spec.norm_offset)


class Embedding(nn.Module):
    """The token embedding [vocab, H]: a parameter, or rows kept in GGUF blocks (CPU) and expanded as
    they are looked up. `scale` multiplies the looked-up rows (Gemma's sqrt(H), in the model dtype)."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.weight = _param(vocab_size, hidden_size, dtype=dtype, device=device)
        self.quantized: QuantizedWeight | None = None
        # HF multiplies in the model dtype: sqrt(H) rounded to it first.
        self.scale = None if scale is None else torch.tensor(scale, dtype=dtype, device=device)

    def load_quantized(self, weight: QuantizedWeight) -> None:
        """Keep the table in its blocks; the float parameter is released."""
        self.quantized = weight
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> [T, H], a fresh buffer (the residual stream starts in it)."""
        if self.quantized is not None:
            hidden = dequantize_rows(self.quantized, input_ids)
        else:
            hidden = self.weight.index_select(0, input_ids)
        return hidden if self.scale is None else hidden.mul_(self.scale)


class Attention(nn.Module):
    """Grouped-query attention's parameters: q/k/v in one projection, o, optional q/k norms."""

    def __init__(self, config: ModelConfig, spec: FamilySpec, linear_cls: LinearFactory, dtype: torch.dtype,
                 device: torch.device | str, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = spec.attn_scale or self.head_dim ** -0.5
        self.sliding_window = config.layer_window(layer_idx)
        self.soft_cap = spec.attn_soft_cap
        self.qkv_proj = linear_cls(config.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias, dtype, device,
                                   output_partitions=(self.q_size, self.kv_size, self.kv_size))
        self.o_proj = linear_cls(self.q_size, config.hidden_size, spec.o_bias, dtype, device)
        self.q_norm = make_norm(spec, self.head_dim, config.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.k_norm = make_norm(spec, self.head_dim, config.rms_norm_eps, dtype, device) if spec.qk_norm else None


class MLP(nn.Module):
    """The gated MLP's parameters: gate and up in one projection, then down."""

    def __init__(self, config: ModelConfig, linear_cls: LinearFactory, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.is_gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = linear_cls(config.hidden_size, 2 * config.intermediate_size, False, dtype, device,
                                       output_partitions=(config.intermediate_size, config.intermediate_size))
        self.down_proj = linear_cls(config.intermediate_size, config.hidden_size, False, dtype, device)


class DecoderLayer(nn.Module):
    """One pre-norm residual block's parameters; with `spec.post_norms` the attention and MLP outputs
    are normed too before they join the residual stream (Gemma 2/3, GLM-4)::

        h += post_self_attn_layernorm(attn(input_layernorm(h)))
        h += post_mlp_layernorm(mlp(post_attention_layernorm(h)))
    """

    def __init__(self, config: ModelConfig, spec: FamilySpec, linear_cls: LinearFactory, dtype: torch.dtype,
                 device: torch.device | str, layer_idx: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = make_norm(spec, hidden, eps, dtype, device)
        self.self_attn = Attention(config, spec, linear_cls, dtype, device, layer_idx)
        self.post_attention_layernorm = make_norm(spec, hidden, eps, dtype, device)
        # A mixture-of-experts layer (Qwen3-MoE, Mixtral) has a `SparseMoE` in the dense MLP's place.
        self.mlp = (SparseMoE(config, dtype, device) if config.is_moe_layer(layer_idx)
                    else MLP(config, linear_cls, dtype, device))
        self.post_self_attn_layernorm = make_norm(spec, hidden, eps, dtype, device) if spec.post_norms else None
        self.post_mlp_layernorm = make_norm(spec, hidden, eps, dtype, device) if spec.post_norms else None


class DecoderBody(nn.Module):
    """HF's `model.`: the embedding, the layers and the final norm."""

    def __init__(self, config: ModelConfig, spec: FamilySpec, linear_cls: LinearFactory, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, spec.embedding_scale, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, linear_cls, dtype, device, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = make_norm(spec, config.hidden_size, config.rms_norm_eps, dtype, device)


def _linear_target(module_name: str) -> tuple[str, int | None]:
    """A checkpoint module name -> (our Linear's name, its partition; None = every row)."""
    for part, (fused, index) in _PARTITIONED.items():
        if module_name.endswith(f".{part}"):
            return module_name[: -len(part)] + fused, index
    return module_name, None


def load_weights(model: nn.Module, spec: FamilySpec, config: ModelConfig,
                 weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
    """Fill `model` (a `DecoderModel`: `model.` a `DecoderBody`, and `lm_head`) from HF-named tensors.

    Projection rows go to their Linear through `load_rows` (a `QuantizedWeight` as it is: the Linear
    variant decides whether it keeps the blocks); a quantized embedding stays in its blocks and serves
    a tied lm_head so. Every parameter must be covered; an unknown name or a wrong shape raises
    `UnsupportedModelError` naming the tensor. Call `finish_loading()` after."""
    params = dict(model.named_parameters(remove_duplicate=False))
    num_rows = {name: param.shape[0] for name, param in params.items()}  # before any is released
    linears = {name: module for name, module in model.named_modules() if isinstance(module, LinearBase)}
    is_tied = config.tie_word_embeddings
    loaded: dict[str, int] = {}
    with torch.no_grad():
        for name, tensor in family_weights(spec, config, weights):
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and is_tied):
                continue  # a tied checkpoint may still store a copy
            module_name, _, kind = name.rpartition(".")
            linear_name, partition = _linear_target(module_name)
            linear = linears.get(linear_name)
            if linear is not None and kind in ("weight", "bias"):
                target = f"{linear_name}.{kind}"
                first, rows = linear.partition_rows(partition)
                _check_shape(name, tensor, (rows, linear.in_features) if kind == "weight" else (rows,))
                (linear.load_rows if kind == "weight" else linear.load_bias_rows)(first, tensor)
            elif name in params:
                target = name
                _check_shape(name, tensor, tuple(params[name].shape))
                if name == "model.embed_tokens.weight" and isinstance(tensor, QuantizedWeight):
                    if is_tied:
                        model.lm_head.load_rows(0, tensor)
                    model.model.embed_tokens.load_quantized(tensor)
                else:
                    params[name].copy_(dequantize_rows(tensor) if isinstance(tensor, QuantizedWeight) else tensor)
            else:
                raise UnsupportedModelError(f"unexpected weight {name!r} for {config.architecture}")
            loaded[target] = loaded.get(target, 0) + tensor.shape[0]
    missing = [name for name in params if loaded.get(name, 0) != num_rows[name]
               and not (name == "lm_head.weight" and is_tied)]
    if missing:
        raise UnsupportedModelError(f"checkpoint lacks weights: {', '.join(missing[:8])}")


def _check_shape(name: str, tensor: torch.Tensor | QuantizedWeight, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise UnsupportedModelError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
