"""Which quantization a decoder is loaded with, and what it reports (GetModelInfo, /v1/models, the log).

The loader asks three things here: whether a checkpoint folder is quantized (`read_quant_spec`), which
`LinearBase` variant its projections take (`QuantizedLinear` for every quantized load), and the summary
of what was loaded (`summarize_model`). `quantize_loaded_model` re-loads an already loaded 16-bit model
with in-situ quantized projections (random `--load-format dummy` weights, the benchmarks).
"""

from __future__ import annotations

import logging

import torch

from inference_service.errors import UnsupportedModelError
from inference_service.model.decoder import DecoderModel
from inference_service.model.linear import LinearBase
from inference_service.model.quant.config import (
    QuantizationConfigError,
    QuantMethod,
    QuantSpec,
    parse_quantization_config,
)
from inference_service.model.quant.in_situ import IN_SITU_METHODS
from inference_service.model.quant.loading import (
    QuantizationSummary,
    in_situ_weights,
    quantized_safetensors_weights,
)
from inference_service.model.quantized_linear import QuantizedLinear, runs_packed

logger = logging.getLogger(__name__)

_LABELS = {QuantMethod.GPTQ: "gptq", QuantMethod.AWQ: "awq", QuantMethod.PACKED_INT: "compressed-tensors",
           QuantMethod.FP8: "fp8"}


def read_quant_spec(hf_config: dict, quantization: str | None) -> QuantSpec | None:
    """The checkpoint's `quantization_config` parsed (None when it has none). A malformed one is a
    `QuantizationConfigError` naming the field; `--quantization` on a checkpoint that is quantized
    already is an `UnsupportedModelError`."""
    if "quantization_config" not in hf_config:
        return None
    spec = parse_quantization_config(hf_config["quantization_config"])
    if quantization is not None:
        raise UnsupportedModelError(f"--quantization {quantization}: the checkpoint is quantized already "
                                    f"({_LABELS[spec.method]}); leave --quantization out")
    return spec


def spec_label(spec: QuantSpec) -> str:
    """What GetModelInfo says for a checkpoint's quantization: "gptq", "awq", "compressed-tensors", "fp8"."""
    return _LABELS[spec.method]


def check_in_situ(quantization: str | None) -> None:
    if quantization is not None and quantization not in IN_SITU_METHODS:
        raise UnsupportedModelError(f"--quantization must be one of {', '.join(IN_SITU_METHODS)}, got {quantization!r}")


def summarize_model(model: DecoderModel, quantization: str) -> QuantizationSummary:
    """`quantization` ("none" when no projection is packed), the bits of the packed projections (16 when
    none), the weight bytes a step reads, and what the same weights take in 16 bits."""
    linears = [m for m in model.modules() if isinstance(m, LinearBase) and not _is_tied(m, model)]
    described = [d for d in (m.describe() for m in linears) if d is not None]
    counted = {id(p) for linear in linears for p in linear.parameters()}  # a tied lm_head: as the embedding
    unquantized = sum(m.out_features * m.in_features * 2 for m in linears)
    unquantized += sum(p.numel() * min(p.element_size(), 2) for p in model.parameters() if id(p) not in counted)
    unquantized += sum(m.bias.numel() * 2 for m in linears if m.bias is not None)
    if not described:
        return QuantizationSummary("none", 16, model.num_weight_bytes, unquantized)
    return QuantizationSummary(quantization, max(d["bits"] for d in described), model.num_weight_bytes, unquantized)


def _is_tied(linear: LinearBase, model: DecoderModel) -> bool:
    weight = getattr(linear, "weight", None)
    return weight is not None and weight is model.model.embed_tokens.weight


def quantize_loaded_model(model: DecoderModel, method: str, *, release: bool = True) -> DecoderModel:
    """A new model with `model`'s weights, its decoder-block projections quantized in situ (`method`:
    fp8, int8 or int4). With `release`, `model`'s projections are released one by one as they are
    taken, so the device holds about one 16-bit copy at most (`model` is unusable after). `model` must
    keep plain weights (not CPU-packed)."""
    check_in_situ(method)
    quantized = DecoderModel(model.config, device=model.device, dtype=model.dtype,
                             attention_backend=model.attention_backend, fused_kernels=model.fused_kernels,
                             linear_cls=QuantizedLinear)

    def weights():
        for name, param in list(model.named_parameters()):
            if name.endswith(".bias") and param.numel() == 0:
                continue
            if param.numel() == 0:
                raise UnsupportedModelError(f"{name}: the loaded weight was released (CPU-packed); "
                                            "in-situ quantization needs the plain weight")
            yield name, param.detach()
            if release and name.endswith("_proj.weight"):
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    quantized.load_weights(in_situ_weights(weights(), method, model.device))
    return quantized


__all__ = ["QuantizationConfigError", "QuantizedLinear", "runs_packed", "check_in_situ", "in_situ_weights",
           "quantize_loaded_model", "quantized_safetensors_weights", "read_quant_spec", "spec_label",
           "summarize_model"]
