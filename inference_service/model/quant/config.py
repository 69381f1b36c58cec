"""`quantization_config` of a Hugging Face config.json parsed into `QuantSpec`, checked field by field.

Accepted: GPTQ 4-bit (`gptq`: group_size 128 or -1, sym, desc_act either way, checkpoint_format gptq
or gptq_v2), AWQ 4-bit GEMM (`awq`), compressed-tensors (`pack-quantized` int4/int8 symmetric w4a16/w8a16;
`float-quantized` fp8 per tensor, per channel or block) and fp8 (`fp8`, per tensor or
`weight_block_size`). Anything else is a `QuantizationConfigError` naming the field: never a
fallback to wrong numbers.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from inference_service.errors import UnsupportedModelError


class QuantizationConfigError(UnsupportedModelError):
    """A quantization_config field or checkpoint tensor the server cannot use; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"quantization_config: {field}: {message}")
        self.field = field


class QuantMethod(enum.Enum):
    GPTQ = "gptq"
    AWQ = "awq"
    PACKED_INT = "compressed-tensors pack-quantized"
    FP8 = "fp8"


@dataclass(frozen=True)
class QuantSpec:
    """How a checkpoint's linear layers are stored. `group_size` None: one scale per output channel.
    `fp8_block` (rows, cols) of one fp8 scale; None: per channel. `ignore`: module names (or
    `re:` patterns, compressed-tensors style) kept unquantized."""

    method: QuantMethod
    bits: int
    group_size: int | None = None
    desc_act: bool = False
    zero_offset: int = 0  # GPTQ v1 stores zero - 1
    fp8_block: tuple[int, int] | None = None
    fp8_per_tensor: bool = False
    fp8_scale_name: str = "weight_scale"
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.group_size is not None and (self.group_size <= 0 or self.group_size % 32):
            raise QuantizationConfigError("group_size", f"a positive multiple of 32 or -1, got {self.group_size}")

    def is_ignored(self, module: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:") and re.match(pattern[3:], module):
                return True
            if module == pattern or module.endswith("." + pattern):
                return True
        return False


def _get(cfg: dict, field: str, path: str, types: type | tuple, default: Any = ...) -> Any:
    if field not in cfg:
        if default is ...:
            raise QuantizationConfigError(path + field, "missing")
        return default
    value = cfg[field]
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):  # bool is an int
        names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise QuantizationConfigError(path + field, f"expected {names}, got {value!r}")
    return value


def _group_size(value: int, field: str) -> int | None:
    if value == -1:
        return None
    if value <= 0 or value % 32:
        raise QuantizationConfigError(field, f"a positive multiple of 32 or -1, got {value}")
    return value


def parse_quantization_config(cfg: dict) -> QuantSpec:
    """`config.json`'s quantization_config -> `QuantSpec`; raises `QuantizationConfigError`."""
    if not isinstance(cfg, dict):
        raise QuantizationConfigError("quantization_config", f"expected an object, got {cfg!r}")
    method = _get(cfg, "quant_method", "", str)
    if method == "gptq":
        return _parse_gptq(cfg)
    if method == "awq":
        return _parse_awq(cfg)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg)
    if method == "fp8":
        return _parse_fp8(cfg)
    raise QuantizationConfigError("quant_method", f"unsupported {method!r}; supported: gptq, awq, compressed-tensors, fp8")


def _require_4_bits(cfg: dict, field: str = "bits", path: str = "") -> int:
    bits = _get(cfg, field, path, int)
    if bits != 4:
        raise QuantizationConfigError(path + field, f"only 4-bit weights are supported, got {bits}")
    return bits


def _parse_gptq(cfg: dict) -> QuantSpec:
    bits = _require_4_bits(cfg)
    group = _group_size(_get(cfg, "group_size", "", int), "group_size")
    if not _get(cfg, "sym", "", bool, True):
        raise QuantizationConfigError("sym", "asymmetric GPTQ is not supported")
    fmt = _get(cfg, "checkpoint_format", "", str, "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationConfigError("checkpoint_format", f"expected gptq or gptq_v2, got {fmt!r}")
    return QuantSpec(QuantMethod.GPTQ, bits, group, desc_act=_get(cfg, "desc_act", "", bool, False),
                     zero_offset=1 if fmt == "gptq" else 0, ignore=tuple(_get(cfg, "modules_to_not_convert", "", (list, type(None)), None) or ()))


def _parse_awq(cfg: dict) -> QuantSpec:
    bits = _require_4_bits(cfg, "bits" if "bits" in cfg else "w_bit")
    group = _group_size(_get(cfg, "group_size" if "group_size" in cfg else "q_group_size", "", int), "group_size")
    version = _get(cfg, "version", "", str, "gemm").lower()
    if version != "gemm":
        raise QuantizationConfigError("version", f"only the GEMM layout is supported, got {version!r}")
    if not _get(cfg, "zero_point", "", bool, True):
        raise QuantizationConfigError("zero_point", "AWQ without zero points is not supported")
    return QuantSpec(QuantMethod.AWQ, bits, group, ignore=tuple(_get(cfg, "modules_to_not_convert", "", (list, type(None)), None) or ()))


def _parse_compressed_tensors(cfg: dict) -> QuantSpec:
    fmt = _get(cfg, "format", "", str)
    groups = _get(cfg, "config_groups", "", dict)
    if len(groups) != 1:
        raise QuantizationConfigError("config_groups", f"exactly one group supported, got {len(groups)}")
    name, group = next(iter(groups.items()))
    path = f"config_groups.{name}."
    weights = _get(group, "weights", path, dict)
    wpath = path + "weights."
    ignore = tuple(_get(cfg, "ignore", "", list, []))
    kind = _get(weights, "type", wpath, str)
    strategy = _get(weights, "strategy", wpath, str)
    if fmt == "pack-quantized":
        if kind != "int":
            raise QuantizationConfigError(wpath + "type", f"pack-quantized needs int weights, got {kind!r}")
        bits = _get(weights, "num_bits", wpath, int)
        if bits not in (4, 8):
            raise QuantizationConfigError(wpath + "num_bits", f"pack-quantized int weights of 4 or 8 bits, got {bits}")
        if not _get(weights, "symmetric", wpath, bool, True):
            raise QuantizationConfigError(wpath + "symmetric", "asymmetric pack-quantized weights are not supported")
        if strategy == "group":
            group_size = _group_size(_get(weights, "group_size", wpath, int), wpath + "group_size")
        elif strategy == "channel":
            group_size = None
        else:
            raise QuantizationConfigError(wpath + "strategy", f"expected group or channel, got {strategy!r}")
        if group.get("input_activations"):
            raise QuantizationConfigError(path + "input_activations", "only weight-only (w4a16) int is supported")
        return QuantSpec(QuantMethod.PACKED_INT, bits, group_size, ignore=ignore)
    if fmt == "float-quantized":
        if kind != "float" or _get(weights, "num_bits", wpath, int) != 8:
            raise QuantizationConfigError(wpath + "type", f"float-quantized needs 8-bit float weights, got {kind!r}")
        if strategy == "tensor":
            return QuantSpec(QuantMethod.FP8, 8, fp8_per_tensor=True, ignore=ignore)
        if strategy == "channel":
            return QuantSpec(QuantMethod.FP8, 8, ignore=ignore)
        if strategy == "block":
            block = _get(weights, "block_structure", wpath, list)
            return QuantSpec(QuantMethod.FP8, 8, fp8_block=_block(block, wpath + "block_structure"), ignore=ignore)
        raise QuantizationConfigError(wpath + "strategy", f"expected tensor, channel or block, got {strategy!r}")
    raise QuantizationConfigError("format", f"expected pack-quantized or float-quantized, got {fmt!r}")


def _block(value: list, field: str) -> tuple[int, int]:
    if len(value) != 2 or not all(isinstance(v, int) and v > 0 and v % 16 == 0 for v in value):
        raise QuantizationConfigError(field, f"expected [rows, cols], multiples of 16, got {value!r}")
    return value[0], value[1]


def _parse_fp8(cfg: dict) -> QuantSpec:
    fmt = _get(cfg, "fmt", "", str, "e4m3")
    if fmt != "e4m3":
        raise QuantizationConfigError("fmt", f"only e4m3 is supported, got {fmt!r}")
    scheme = _get(cfg, "activation_scheme", "", str, "dynamic")
    if scheme != "dynamic":
        raise QuantizationConfigError("activation_scheme", f"only dynamic is supported, got {scheme!r}")
    ignore = tuple(_get(cfg, "modules_to_not_convert", "", (list, type(None)), None) or ())
    block = _get(cfg, "weight_block_size", "", (list, type(None)), None)
    if block is None:
        return QuantSpec(QuantMethod.FP8, 8, fp8_per_tensor=True, fp8_scale_name="weight_scale", ignore=ignore)
    return QuantSpec(QuantMethod.FP8, 8, fp8_block=_block(block, "weight_block_size"),
                     fp8_scale_name="weight_scale_inv", ignore=ignore)
