"""Rotary position embeddings: inverse frequencies per rope type, and the cos/sin tables built from them.

The one place the rope math lives: default, linear, llama3, yarn and longrope frequencies (with
llama.cpp's per-frequency factors) follow Hugging Face's `ROPE_INIT_FUNCTIONS` op for op in float32,
so cos/sin are bit-identical to transformers' and greedy decoding can be compared token for token.
Two table layouts are built from them: `RotaryEmbedding` (the eager path: cos and signed sin, applied
in torch or the C++ kernel) and `build_cos_sin_cache` / `kernel_cos_sin_cache` (the `[cos | sin]`
rows `kernels.apply_rotary` reads on the fused path).
"""

from __future__ import annotations

import math

import torch

from inference_service.cpu_kernels.quant import cpu_ops_for
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    # [dim // 2] float32
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(base: float, dim: int, scaling: dict) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the middle band interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, scaling: dict, max_position_embeddings: int | None
                   ) -> tuple[torch.Tensor, float]:
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if original is None:
        raise UnsupportedModelError("yarn rope scaling needs original_max_position_embeddings or max_position_embeddings")
    factor = scaling.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise UnsupportedModelError("yarn rope scaling without a factor needs max_position_embeddings")
        factor = max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength completes `num_rotations` turns over the original context.
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_weight)
                + inv_freq_extrapolation * extrapolation_weight)
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(base: float, dim: int, scaling: dict, max_position_embeddings: int,
                       long: bool) -> tuple[torch.Tensor, float]:
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * base ** inv_freq_shape), float(attention_factor)


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None = None,
                  max_position_embeddings: int | None = None, *, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, attention scaling applied to cos/sin) for a
    rope type given as Hugging Face's `rope_scaling` dict (None: default).

    `long`: LongRoPE's long-context factors instead of its short ones (other types have one set).
    An unknown type raises `UnsupportedModelError` naming its `rope_type`."""
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default")) if rope_scaling else "default"
    if rope_type == "longrope":
        return _longrope_inv_freq(base, rotary_dim, rope_scaling, max_position_embeddings, long)
    if rope_type == "default":
        return _default_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, rotary_dim) / rope_scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base, rotary_dim, rope_scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, rope_scaling, max_position_embeddings)
    raise UnsupportedModelError(f"unsupported rope_type {rope_type!r} (default, linear, llama3, yarn, longrope)")


def compute_inv_freq(config: ModelConfig, long: bool = False) -> tuple[torch.Tensor, float]:
    """`rope_inv_freq` for a model, with llama.cpp's `rope_freqs.weight` applied: per-frequency
    divisors (how a GGUF stores llama3 scaling)."""
    inv_freq, attention_factor = rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling,
                                               config.max_position_embeddings, long=long)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq, attention_factor


def cos_sin_rows(inv_freq: torch.Tensor, attention_factor: float, max_position: int) -> torch.Tensor:
    """[max_position, rotary_dim] float32 rows `[cos(p f) | sin(p f)] * attention_factor`: the layout
    `kernels.apply_rotary` reads."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [P, R/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor


def build_cos_sin_cache(rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None = None, *,
                        max_position_embeddings: int | None = None, dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """The [max_position, rotary_dim] table `kernels.apply_rotary` reads, for a rope type given as HF's
    `rope_scaling`. LongRoPE picks one of two tables per sequence, which one table cannot express:
    refused (`UnsupportedModelError`, a ValueError, naming its rope_type)."""
    if rope_scaling and rope_scaling.get("rope_type") == "longrope":
        raise UnsupportedModelError("rope_type 'longrope' needs two tables; the kernel cache holds one")
    inv_freq, attention_factor = rope_inv_freq(rotary_dim, base, rope_scaling, max_position_embeddings)
    return cos_sin_rows(inv_freq, attention_factor, max_position).to(dtype=dtype, device=device)


def kernel_cos_sin_cache(config: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """A model's [max_position_embeddings, rotary_dim] float32 table for `kernels.apply_rotary` (the
    kernel rotates in fp32 and rounds once to q's dtype); every rope type and llama.cpp's frequency
    factors apply as on the eager path."""
    return cos_sin_rows(*compute_inv_freq(config), config.max_position_embeddings).to(device)


class RotaryEmbedding:
    """A cos/sin table for positions [0, max_positions), and the rotation applied with it.

    The rotation is Hugging Face's "rotate half" form: x * cos + rotate_half(x) * sin, where
    rotate_half(x) = cat(-x2, x1). We store sin with the sign folded in (`[-sin, sin]`), so the rotation
    is a roll by half the head plus two multiplies and an add, with the same rounding as HF's.

    Partial rotary (`config.rotary_dim` < head_dim: Phi-4-mini, StableLM, GLM-4) rotates the leading
    rotary_dim dims of each head and passes the rest through. LongRoPE keeps a second table of its
    long factors; `lookup(..., use_long=)` picks per token, as HF picks per forward by the sequence's
    length: a sequence whose context exceeds `original_max_position_embeddings` reads the long one.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.head_dim, self.rotary_dim = config.head_dim, config.rotary_dim
        self.max_positions = config.max_position_embeddings
        self.cos, self.sin_signed = self._tables(*compute_inv_freq(config), device, dtype)  # [P, R] each
        self.long_tables = None
        self.original_max_positions = None
        if config.rope_scaling and config.rope_scaling["rope_type"] == "longrope":
            self.long_tables = self._tables(*compute_inv_freq(config, long=True), device, dtype)
            self.original_max_positions = int(config.rope_scaling["original_max_position_embeddings"])
        # NOTE: the C++ rotary takes whole heads; partial rotary rotates a strided slice in torch.
        self._cpu_ops = cpu_ops_for(self.cos) if self.rotary_dim == self.head_dim else None

    def _tables(self, inv_freq: torch.Tensor, attention_factor: float, device, dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]  # [P, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
        cos = emb.cos() * attention_factor
        sin = emb.sin() * attention_factor
        half = self.rotary_dim // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cos.to(device=device, dtype=dtype), sin_signed.to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor, use_long: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for `positions` [T] -> each [T, 1, R], broadcast over heads. `use_long` [T]
        bool picks LongRoPE's long table for those tokens (ignored without one)."""
        cos, sin = self.cos[positions], self.sin_signed[positions]
        if self.long_tables is not None and use_long is not None:
            pick = use_long[:, None]
            cos = torch.where(pick, self.long_tables[0][positions], cos)
            sin = torch.where(pick, self.long_tables[1][positions], sin)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def apply_(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] in place (x may be a view into a larger buffer) and return it."""
        if self._cpu_ops is not None:  # one call, the same arithmetic
            self._cpu_ops.rotary_(x, cos, sin_signed)
            return x
        part = x[..., :self.rotary_dim] if self.rotary_dim < self.head_dim else x  # [T, H, R]
        rotated = torch.roll(part, shifts=self.rotary_dim // 2, dims=-1)  # [T, H, R] = cat(x2, x1)
        rotated.mul_(sin_signed)
        part.mul_(cos).add_(rotated)
        return x
