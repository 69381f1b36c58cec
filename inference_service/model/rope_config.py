"""The rotary-embedding fields of a model config: base, scaling and rotated fraction, as each family's HF
`config.json` (or a GGUF's metadata) spells them. Used by `model/config.py`."""

from __future__ import annotations

from typing import Any

from inference_service.errors import UnsupportedModelError


def partial_rotary_factor(cfg: dict[str, Any], model_type: str) -> float:
    params = cfg.get("rope_parameters") or {}
    for source in (params, cfg):
        if isinstance(source, dict) and source.get("partial_rotary_factor") is not None:
            return source["partial_rotary_factor"]
    return {"glm4": 0.5, "stablelm": 0.25}.get(model_type, 1.0)  # HF's defaults


def family_rope(cfg: dict[str, Any], model_type: str) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, rope_local_theta). Gemma 3 keeps one rope per layer type: the global
    layers' (with its scaling) and the sliding layers' plain base (`rope_local_base_freq`)."""
    if model_type != "gemma3_text":
        rope_theta, rope_scaling = _hf_rope(cfg, longrope_aliases=model_type == "phi3")
        return rope_theta, rope_scaling, None
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        local_theta = local.get("rope_theta", 10_000.0)
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"Gemma3 sliding-layer rope_type {local['rope_type']!r} is not supported")
        rope_theta, rope_scaling = _hf_rope({**cfg, "rope_parameters": {"rope_theta": 1_000_000.0, **full},
                                             "rope_scaling": None})
        return rope_theta, rope_scaling, float(local_theta)
    rope_theta, rope_scaling = _hf_rope({**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)})
    return rope_theta, rope_scaling, float(cfg.get("rope_local_base_freq", 10_000.0))


def _hf_rope(cfg: dict[str, Any], longrope_aliases: bool = False) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the new `rope_parameters` or legacy `rope_scaling`.

    `longrope_aliases`: Phi-3 configs name LongRoPE "su" or "yarn" (HF reads both as "longrope")."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    merged = {**params, **legacy}
    merged.pop("partial_rotary_factor", None)  # a field of its own (`ModelConfig.partial_rotary_factor`)
    rope_theta = float(merged.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if longrope_aliases and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type == "default":
        return rope_theta, None
    if rope_type == "longrope":
        merged.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        for key in ("short_factor", "long_factor", "original_max_position_embeddings"):
            if merged.get(key) is None:
                raise UnsupportedModelError(f"longrope rope scaling lacks {key}")
    if rope_type in ("llama3", "yarn"):
        merged.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")))
    return rope_theta, {"rope_type": rope_type, **merged}


def gguf_rope_scaling(get) -> dict[str, Any] | None:
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
