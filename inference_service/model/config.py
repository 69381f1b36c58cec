"""`ModelConfig`: the decoder's shape, read from a Hugging Face `config.json` or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from inference_service.errors import UnsupportedModelError

# HF architecture name -> model_type of the one decoder implementation that serves it.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# GGUF `general.architecture` -> (model_type, HF architecture).
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(slots=True)
class ModelConfig:
    """The decoder's hyper-parameters, under Hugging Face's names.

    `rope_scaling` is None for plain RoPE, otherwise a dict with at least `rope_type` (one of
    `ROPE_TYPES`) and that type's parameters, using HF's keys (`factor`,
    `original_max_position_embeddings`, `low_freq_factor`, `beta_fast`, `attention_factor`, ...).
    `rope_freq_factors` holds llama.cpp's per-frequency divisors (GGUF `rope_freqs.weight`) when a
    GGUF carries them instead of `rope_scaling` metadata.
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
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {self.hidden_act!r}; only 'silu' is supported")
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
        hidden_size = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _hf_rope(cfg)
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(f"{architecture} with mlp_bias=true is not supported")
        # NOTE: we attend over the whole context; a sliding window shorter than it would differ.
        window = cfg.get("sliding_window")
        uses_window = cfg.get("use_sliding_window", model_type == "mistral")
        if uses_window and window and window < cfg.get("max_position_embeddings", 0):
            raise UnsupportedModelError(f"{architecture} with sliding_window={window} is not supported")
        return cls(
            model_type=model_type,
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; the others say so in `attention_bias`.
            attention_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            use_qk_norm=model_type == "qwen3",
            hidden_act=cfg.get("hidden_act", "silu"),
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
            rope_scaling=_gguf_rope_scaling(get),
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            use_qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_freq_factors=rope_freq_factors,
        )


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the new `rope_parameters` or legacy `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    merged = {**params, **legacy}
    rope_theta = float(merged.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type == "default":
        return rope_theta, None
    if rope_type in ("llama3", "yarn"):
        merged.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")))
    return rope_theta, {"rope_type": rope_type, **merged}


def _gguf_rope_scaling(get) -> dict[str, Any] | None:
    """llama.cpp's `rope.scaling.*` keys, renamed to HF's."""
    rope_type = get("rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    factor = get("rope.scaling.factor")
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if rope_type == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = get("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                                 ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if get(gguf_key) is not None:
                scaling[hf_key] = float(get(gguf_key))
        return scaling
    raise UnsupportedModelError(f"unsupported GGUF rope scaling type {rope_type!r}")


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
