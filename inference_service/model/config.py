"""`ModelConfig`: the decoder's shape, read from a Hugging Face `config.json` or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from inference_service.errors import UnsupportedModelError
from inference_service.model.rope_config import family_rope, gguf_rope_scaling, partial_rotary_factor

# HF architecture name -> model_type of the one decoder implementation that serves it.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Yi and other Llama-layout checkpoints too
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "StableLmForCausalLM": "stablelm",
    "Glm4ForCausalLM": "glm4",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# GGUF `general.architecture` -> (model_type, HF architecture).
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(slots=True)
class ModelConfig:
    """The decoder's hyper-parameters, under Hugging Face's names.

    `rope_scaling` is None for plain RoPE, otherwise a dict with at least `rope_type` (one of
    `ROPE_TYPES`) and that type's parameters, using HF's keys (`factor`,
    `original_max_position_embeddings`, `low_freq_factor`, `beta_fast`, `attention_factor`, ...).
    `rope_freq_factors` holds llama.cpp's per-frequency divisors (GGUF `rope_freqs.weight`) when a
    GGUF carries them instead of `rope_scaling` metadata.

    `layer_types` says per layer whether it attends over the last `sliding_window` tokens only
    ("sliding_attention") or the whole context; None with a `sliding_window` = every layer slides.
    `rms_norm_eps` is the epsilon of the model's norms, LayerNorm ones (StableLM) included.
    `rope_local_theta`: the RoPE base of the sliding layers when it differs (Gemma 3).

    Mixture of experts (Qwen3-MoE, Mixtral; `model/moe.py`): `num_experts` > 0 makes the layers in
    `moe_layers` (None = every layer) route each token to `num_experts_per_tok` experts of
    `moe_intermediate_size`; `norm_topk_prob` renormalizes the chosen experts' weights to sum to 1.
    """

    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    use_qk_norm: bool = False
    hidden_act: str = "silu"
    rope_freq_factors: list[float] | None = field(default=None, repr=False)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    partial_rotary_factor: float = 1.0
    rope_local_theta: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {self.architecture!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModelError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise UnsupportedModelError(f"unsupported hidden_act {self.hidden_act!r}; supported: {list(HIDDEN_ACTS)}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise UnsupportedModelError(f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise UnsupportedModelError(
                    f"layer_types must name {self.num_hidden_layers} layers, each one of {list(LAYER_TYPES)}; "
                    f"got {list(self.layer_types)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise UnsupportedModelError("layer_types has sliding_attention layers but sliding_window is not set")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise UnsupportedModelError(f"{name} must be positive, got {value!r}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim == 0:
            raise UnsupportedModelError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dims {self.rotary_dim} of "
                f"head_dim {self.head_dim}; they must be a positive even number")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise UnsupportedModelError(
                    f"mixture of experts needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0; "
                    f"got {self.num_experts_per_tok} of {self.num_experts}, moe_intermediate_size "
                    f"{self.moe_intermediate_size}")
            if self.moe_layers is not None and not set(self.moe_layers) <= set(range(self.num_hidden_layers)):
                raise UnsupportedModelError(f"moe_layers {list(self.moe_layers)} name layers past "
                                            f"{self.num_hidden_layers}")
        if not self.rms_norm_eps > 0:
            raise UnsupportedModelError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise UnsupportedModelError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in ROPE_TYPES:
                raise UnsupportedModelError(
                    f"unsupported rope scaling type {rope_type!r}; supported: {list(ROPE_TYPES)}"
                )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`; None = it attends over the whole context."""
        if self.sliding_window is None or self.sliding_window >= self.max_position_embeddings:
            return None  # NOTE: a window as long as the context masks nothing
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    # ------------------------------------------------------------------ Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json` (nested `text_config`, `rope_parameters` and legacy
        `rope_scaling` included). Raises `UnsupportedModelError` for architectures we do not serve."""
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else ""
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {architecture or raw.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        # NOTE: multimodal-style configs keep the decoder's fields in `text_config`; the top level wins
        # only for what the text config lacks.
        cfg = {**raw, **(raw.get("text_config") or {})}
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        _refuse_unsupported_fields(cfg, architecture, model_type)
        hidden_size = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        rope_theta, rope_scaling, rope_local_theta = family_rope(cfg, model_type)
        is_gemma = model_type in ("gemma2", "gemma3_text")
        window, layer_types = cfg.get("sliding_window"), cfg.get("layer_types")
        if is_gemma and layer_types is None:
            # HF's defaults: Gemma 2 alternates local/global from layer 0; Gemma 3 has 5 local, 1 global.
            period = 2 if model_type == "gemma2" else int(cfg.get("sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            window = None  # Qwen's sliding_window applies only with use_sliding_window
        if model_type in ("llama", "stablelm", "glm4"):
            window = None  # not part of these architectures
        default_bias = {"qwen2": True, "glm4": True}.get(model_type, False)
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=float(cfg.get("layer_norm_eps" if model_type == "stablelm" else "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma)),
            # Qwen2 always has q/k/v biases, StableLM says so in `use_qkv_bias`, the others in `attention_bias`.
            attention_bias=True if model_type == "qwen2" else bool(
                cfg.get("use_qkv_bias" if model_type == "stablelm" else "attention_bias", default_bias)),
            use_qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            hidden_act=(cfg.get("hidden_activation") or "gelu_pytorch_tanh") if is_gemma else cfg.get("hidden_act", "silu"),
            sliding_window=window,
            layer_types=tuple(layer_types) if layer_types is not None and window is not None else None,
            # NOTE: Gemma 3's attention ignores attn_logit_softcapping (HF passes it no softcap). Absent
            # keys take HF's defaults.
            attn_logit_softcapping=cfg.get("attn_logit_softcapping", 50.0) if model_type == "gemma2" else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None)
            if is_gemma else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256) if is_gemma else None,
            partial_rotary_factor=float(partial_rotary_factor(cfg, model_type)),
            rope_local_theta=rope_local_theta,
            **_hf_moe_fields(cfg, model_type, num_layers),
        )

    # ------------------------------------------------------------------ GGUF metadata

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str],
                           rope_freq_factors: list[float] | None = None) -> ModelConfig:
        """Build from GGUF key/values (`general.architecture`, `{arch}.context_length`, ...).

        `tensor_names` decides what the metadata does not state: tied embeddings (no `output.weight`)
        and attention biases (`blk.0.attn_q.bias`)."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
            )
        model_type, architecture = GGUF_ARCHITECTURES[arch]

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        num_experts = int(get("expert_count") or 0)
        if arch == "llama" and num_experts:
            model_type, architecture = "mixtral", "MixtralForCausalLM"  # llama.cpp writes Mixtral as llama

        def need(key: str) -> Any:
            value = get(key)
            if value is None:
                raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
            return value

        hidden_size = int(need("embedding_length"))
        num_heads = int(need("attention.head_count"))
        head_dim = get("attention.key_length") or hidden_size // num_heads
        vocab_size = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(need("feed_forward_length")),
            num_hidden_layers=int(need("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("attention.head_count_kv") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=gguf_rope_scaling(get),
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            use_qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_freq_factors=rope_freq_factors,
            num_experts=num_experts,
            num_experts_per_tok=int(get("expert_used_count") or 0),
            moe_intermediate_size=int(get("expert_feed_forward_length") or need("feed_forward_length"))
            if num_experts else 0,
            # NOTE: llama.cpp renormalizes the top-k weights of both (Qwen3-MoE checkpoints all set
            # norm_topk_prob); a file may say otherwise in expert_weights_norm.
            norm_topk_prob=bool(get("expert_weights_norm", True)),
        )


# Config fields whose truthy value asks for something the decoder does not implement, per family.
_UNSUPPORTED_FIELDS = {
    "stablelm": ("qk_layernorm", "use_parallel_residual"),
    "gemma2": ("use_bidirectional_attention",),
    "gemma3_text": ("use_bidirectional_attention",),
}


def _refuse_unsupported_fields(cfg: dict[str, Any], architecture: str, model_type: str) -> None:
    for name in ("mlp_bias", *_UNSUPPORTED_FIELDS.get(model_type, ())):
        if cfg.get(name):
            raise UnsupportedModelError(f"{architecture} with {name}={cfg[name]!r} is not supported")
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window") and window \
            and window < cfg.get("max_position_embeddings", 0):
        # NOTE: Qwen slides only in the layers from max_window_layers on; not implemented.
        raise UnsupportedModelError(f"{architecture} with use_sliding_window (sliding_window={window}) is not supported")


def _hf_moe_fields(cfg: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from a Qwen3-MoE or Mixtral config.json."""
    if model_type == "mixtral":
        return dict(num_experts=int(cfg.get("num_local_experts", 8)),
                    num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if model_type != "qwen3_moe":
        return {}
    # Hub checkpoints say num_experts; transformers 5 writes it as num_local_experts.
    num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
    step, dense_layers = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
    # HF: a layer is sparse unless listed in mlp_only_layers, and then only every decoder_sparse_step-th.
    moe_layers = tuple(i for i in range(num_layers)
                       if i not in dense_layers and num_experts > 0 and (i + 1) % step == 0)
    return dict(num_experts=num_experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=None if len(moe_layers) == num_layers else moe_layers)


def with_yarn_scaling(config: ModelConfig, factor: float) -> ModelConfig:
    """The config with YaRN turned on at `factor`: the trained context stretched `factor` times."""
    if not factor or factor <= 1.0:
        raise UnsupportedModelError(f"yarn_scaling_factor must be > 1.0, got {factor}")
    original = config.max_position_embeddings
    if config.rope_scaling and config.rope_scaling.get("original_max_position_embeddings"):
        original = config.rope_scaling["original_max_position_embeddings"]

    return replace(
        config,
        rope_scaling={"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original},
        max_position_embeddings=int(original * factor),
    )
