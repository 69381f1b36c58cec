"""`FamilySpec`: the switches that turn the one decoder into each model family.

    family      norm          qkv bias  qk-norm  post-norms  activation  embed x sqrt(H)  soft caps  rotary
    llama/yi    rms           opt.      -        -           silu        -                -          full
    mistral     rms           -         -        -           silu        -                -          full (+window)
    qwen2       rms           yes       -        -           silu        -                -          full
    qwen3       rms           -         rms      -           silu        -                -          full
    gemma2      rms (1 + w)   opt.      -        yes         gelu tanh   yes              attn+final full, local/global
    gemma3      rms (1 + w)   opt.      (1 + w)  yes         gelu tanh   yes              final      two bases
    phi3        rms           -         -        -           silu        -                -          partial, longrope
    stablelm    layernorm+b   opt.      -        -           silu        -                -          partial
    glm4        rms           yes       -        yes         silu        -                -          partial, interleaved
    qwen3_moe   as qwen3, with a mixture-of-experts MLP (`moe.py`) in its sparse layers
    mixtral     as mistral, every MLP a mixture of experts (`block_sparse_moe.` in the checkpoint)

The numbers (window, caps, rotary dims, rope bases) live in `ModelConfig`; the spec holds what the
family's code does with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_service.model.config import ModelConfig

NORM_KINDS = ("rms", "layer")
ROPE_LAYOUTS = ("neox", "interleaved")


@dataclass(frozen=True)
class FamilySpec:
    """What sets one model family apart from the shared decoder."""

    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False
    norm_kind: str = "rms"  # "rms" or "layer" (LayerNorm with a bias)
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (1 + weight)
    post_norms: bool = False  # a norm on the attention output and on the MLP output (Gemma 2/3, GLM-4)
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_pytorch_tanh"
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None = head_dim ** -0.5
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    rope_layout: str = "neox"  # "interleaved": q/k rows are regrouped into halves at load (GLM-4)
    # Checkpoint layer-suffix renames onto our module names (Gemma calls its post-attention norm
    # `post_attention_layernorm`, our name for the norm before the MLP).
    weight_renames: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.norm_kind not in NORM_KINDS:
            raise ValueError(f"norm_kind must be one of {NORM_KINDS}, got {self.norm_kind!r}")
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")

    @classmethod
    def from_config(cls, config: ModelConfig) -> FamilySpec:
        family = config.model_type
        common = dict(qkv_bias=config.attention_bias, qk_norm=config.use_qk_norm, activation=config.hidden_act)
        if family in ("gemma2", "gemma3_text"):
            return cls(**common, o_bias=config.attention_bias, norm_offset=1.0, post_norms=True,
                       embedding_scale=config.hidden_size ** 0.5,
                       attn_scale=(config.query_pre_attn_scalar or config.head_dim) ** -0.5,
                       attn_soft_cap=config.attn_logit_softcapping, final_soft_cap=config.final_logit_softcapping,
                       weight_renames=(("post_attention_layernorm.", "post_self_attn_layernorm."),
                                       ("pre_feedforward_layernorm.", "post_attention_layernorm."),
                                       ("post_feedforward_layernorm.", "post_mlp_layernorm.")))
        if family == "glm4":
            return cls(**common, post_norms=True, rope_layout="interleaved")
        if family == "stablelm":
            return cls(**common, norm_kind="layer")
        if family == "mixtral":
            return cls(**common, weight_renames=(("block_sparse_moe.", "mlp."),))
        return cls(**common, o_bias=config.attention_bias and family == "llama")

    def fused_path_gaps(self, config: ModelConfig) -> list[str]:
        """The features of this model the fused GPU stack (`fused_stack.py`) do not implement yet."""
        gaps = []
        if self.norm_kind != "rms":
            gaps.append("LayerNorm")
        if self.norm_offset:
            gaps.append("(1 + weight) RMSNorm")
        if self.post_norms:
            gaps.append("post-attention / post-MLP norms")
        if self.activation != "silu":
            gaps.append(f"{self.activation} activation")
        if self.embedding_scale is not None:
            gaps.append("embedding scaling")
        if self.final_soft_cap is not None:
            gaps.append("final logit soft-capping")
        if self.o_bias:
            gaps.append("o_proj bias")
        if config.rotary_dim != config.head_dim:
            gaps.append("partial rotary")
        if config.rope_local_theta is not None:
            gaps.append("a second RoPE base for sliding layers")
        if config.rope_scaling and config.rope_scaling["rope_type"] == "longrope":
            gaps.append("longrope rope scaling")
        return gaps
