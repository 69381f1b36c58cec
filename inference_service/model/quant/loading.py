"""What a loader needs around the packed forms: which checkpoint tensors make up one quantized layer,
which 16-bit tensors in-situ quantization takes, and the summary GetModelInfo, /v1/models and the
startup log report (quantization, bits, weight memory)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from inference_service.model.quant.config import (
    QuantizationConfigError,
    QuantMethod,
    QuantSpec,
)
from inference_service.model.quant.summary import PackedWeight, describe_weight

# Readers of a checkpoint tensor from its safetensors slice: a plain tensor by name, a quantized layer's tensors
# by suffix (`quantized_safetensors_weights`).
ReadPlain = Callable[[str, object], torch.Tensor]
ReadLayer = Callable[[str, dict[str, object]], dict[str, torch.Tensor]]

# The tensor that marks a quantized layer, and every suffix the layer owns, per method.
_MARKER = {QuantMethod.GPTQ: "qweight", QuantMethod.AWQ: "qweight", QuantMethod.PACKED_INT: "weight_packed"}
_SUFFIXES = {QuantMethod.GPTQ: ("qweight", "qzeros", "scales", "g_idx"),
             QuantMethod.AWQ: ("qweight", "qzeros", "scales"),
             QuantMethod.PACKED_INT: ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
             QuantMethod.FP8: ("weight", "weight_scale", "weight_scale_inv", "input_scale")}
# Linear layers of a decoder block that in-situ quantization takes (embeddings, lm_head, norms stay).
# Our fused names too: a loaded model's projections are re-quantized by them (`quantize_loaded_model`).
IN_SITU_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                       "qkv_proj", "gate_up_proj")
# safetensors dtypes of the tensors outside quantized layers (cast to the model dtype).
_PLAIN_DTYPES = {"F32", "F16", "BF16"}
# Buffers some checkpoints save beside the weights; never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embeddings.position_ids")


def group_layer_tensors(names: Iterable[str], spec: QuantSpec) -> tuple[dict[str, dict[str, str]], list[str]]:
    """Checkpoint tensor names -> ({layer prefix: {suffix: name}} of the quantized layers, the other names).

    A layer is quantized when its marker tensor is present (`qweight`, `weight_packed`, or for fp8 the
    scale named by the config); `spec.ignore` layers are then an error elsewhere, not here."""
    names = list(names)
    marker = _MARKER.get(spec.method, spec.fp8_scale_name)
    prefixes = {n[: -len(marker) - 1] for n in names if n.endswith("." + marker)}
    layers: dict[str, dict[str, str]] = {p: {} for p in prefixes}
    rest = []
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if prefix in layers and suffix in _SUFFIXES[spec.method]:
            layers[prefix][suffix] = name
        else:
            rest.append(name)
    return layers, rest


def is_in_situ_target(name: str, tensor: torch.Tensor) -> bool:
    """Whether `--quantization` quantizes this checkpoint tensor: a decoder block's projection weight."""
    parts = name.split(".")
    return (tensor.dim() == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in IN_SITU_PROJECTIONS
            and tensor.dtype in (torch.float16, torch.bfloat16, torch.float32))


@dataclass(frozen=True)
class QuantizationSummary:
    """What the server reports: `quantization` ("none", "gptq", "gguf Q4_K", "in-situ int4", ...),
    `bits` of the quantized projections (16 when none), `weight_bytes` of every weight on the device,
    `unquantized_bytes` what the same weights take in the 16-bit dtype."""

    quantization: str
    bits: int
    weight_bytes: int
    unquantized_bytes: int

    def log_line(self) -> str:
        saved = self.unquantized_bytes - self.weight_bytes
        return (f"quantization {self.quantization}: {self.bits}-bit projections, weights {self.weight_bytes / 1e9:.2f} GB "
                f"({saved / 1e9:.2f} GB less than 16-bit)")


def summarize(weights: Mapping[str, PackedWeight | torch.Tensor], quantization: str) -> QuantizationSummary:
    """The summary of a loaded model's weights (packed layers and plain tensors, by name)."""
    packed = [w for w in weights.values() if not isinstance(w, torch.Tensor)]
    bits = {describe_weight(w)["bits"] for w in packed}
    total = unquantized = 0
    for w in weights.values():
        if isinstance(w, torch.Tensor):
            total += w.numel() * w.element_size()
            unquantized += w.numel() * min(w.element_size(), 2)
        else:
            n, k = w.shape
            total += w.nbytes
            unquantized += n * k * 2
    return QuantizationSummary(quantization if packed else "none", max(bits) if bits else 16, total, unquantized)


def quantized_safetensors_weights(files: list[str], spec: QuantSpec, dtype: torch.dtype,
                                  device: torch.device | str, read_plain: ReadPlain | None = None,
                                  read_layer: ReadLayer | None = None
                                  ) -> Iterator[tuple[str, PackedWeight | torch.Tensor]]:
    """A quantized checkpoint's tensors as the loader takes them: each quantized layer once, as
    (`prefix.weight`, its packed form on `device`), every other tensor cast to `dtype`. Tensors of one
    layer may lie in different shards. A tensor outside a quantized layer in a dtype other than
    F32/F16/BF16, or a layer the spec says to ignore that came quantized, raises
    `QuantizationConfigError` naming it (before any work). `read_plain(name, slice)` and
    `read_layer(prefix, {suffix: slice})` read the tensors (default: whole; a tensor-parallel rank
    reads its part, `distributed/quant_shards.py`)."""
    from safetensors import safe_open

    from inference_service.model.quant.checkpoint import pack_checkpoint_linear

    where: dict[str, str] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                where[name] = file
    layers, rest = group_layer_tensors(where, spec)
    for prefix in layers:
        if spec.is_ignored(prefix):
            raise QuantizationConfigError(prefix, "is listed as not quantized but its tensors are")
    with ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="pt")) for file in files}
        for name in rest:
            kind = handles[where[name]].get_slice(name).get_dtype()
            if kind not in _PLAIN_DTYPES and not name.endswith(_IGNORED_SUFFIXES):
                raise QuantizationConfigError(name, f"dtype {kind} outside a quantized layer (expected one of "
                                                    f"{sorted(_PLAIN_DTYPES)})")
        for name in rest:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            handle = handles[where[name]]
            # NOTE: GPTQ exporters save a zero bias beside every quantized layer, also for models without
            # biases; adding zero changes nothing, so it is dropped rather than refused. Decided on the
            # checkpoint's bias (small), not on this rank's part: a row-parallel bias is zeros on every
            # tensor-parallel rank but the first, and dropping it there left the rank without it.
            if name.endswith(".bias") and name[: -len(".bias")] in layers and not handle.get_tensor(name).any():
                continue
            tensor = read_plain(name, handle.get_slice(name)) if read_plain is not None else handle.get_tensor(name)
            yield name, tensor.to(dtype)
        for prefix, parts in layers.items():
            if read_layer is not None:
                tensors = read_layer(prefix, {suffix: handles[where[name]].get_slice(name) for suffix, name in parts.items()})
            else:
                tensors = {suffix: handles[where[name]].get_tensor(name) for suffix, name in parts.items()}
            tensors = {suffix: tensor.to(device) for suffix, tensor in tensors.items()}
            yield f"{prefix}.weight", pack_checkpoint_linear(spec, prefix, tensors)


def in_situ_weights(weights: Iterable[tuple[str, object]], method: str, device: torch.device | str
                    ) -> Iterator[tuple[str, object]]:
    """`weights` with every decoder-block projection quantized by `quantize_in_situ` on `device` (one
    tensor at a time, so the 16-bit model is never on the device whole)."""
    from inference_service.model.quant.in_situ import quantize_in_situ

    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor) and is_in_situ_target(name, tensor):
            yield name, quantize_in_situ(tensor.to(device), method)
        else:
            yield name, tensor
