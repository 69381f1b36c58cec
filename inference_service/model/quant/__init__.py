"""Quantized weights for the GPU: every checkpoint format parsed into one of two packed forms the
kernels take (`kernels.quant_layout.IntPackedWeight` for integer codes, `kernels.fp8_gemm.Fp8Weight`
for e4m3), repacked once at load.

- `config.py`: `quantization_config` (gptq, awq, compressed-tensors, fp8) -> `QuantSpec`.
- `checkpoint.py`: one layer's checkpoint tensors -> the packed form.
- `gguf_types.py`: GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K blocks -> `IntPackedWeight`.
- `in_situ.py`: a 16-bit tensor quantized at load (`--quantization fp8|int8|int4`).
- `packed_linear.py`: the matmul of a quantized Linear, any format; the 16-bit twin.
- `rows.py`: rows stacked (fused q/k/v, gate/up) or reordered.
- `loading.py`: a quantized layer's tensors by name, in-situ targets, the reported summary.
"""

from inference_service.model.quant.checkpoint import pack_checkpoint_linear
from inference_service.model.quant.config import (
    QuantizationConfigError,
    QuantMethod,
    QuantSpec,
    parse_quantization_config,
)
from inference_service.model.quant.gguf_types import (
    GGUF_PACKED_TYPES,
    repack_gguf,
    repack_reader_tensor,
)
from inference_service.model.quant.in_situ import IN_SITU_METHODS, quantize_in_situ
from inference_service.model.quant.loading import (
    QuantizationSummary,
    group_layer_tensors,
    is_in_situ_target,
    summarize,
)
from inference_service.model.quant.packed_linear import dequantize_packed, packed_linear
from inference_service.model.quant.rows import concat_rows, select_rows
from inference_service.model.quant.summary import PackedWeight, describe_weight

__all__ = [
    "GGUF_PACKED_TYPES",
    "IN_SITU_METHODS",
    "PackedWeight",
    "QuantMethod",
    "QuantSpec",
    "QuantizationConfigError",
    "QuantizationSummary",
    "concat_rows",
    "dequantize_packed",
    "describe_weight",
    "group_layer_tensors",
    "is_in_situ_target",
    "pack_checkpoint_linear",
    "packed_linear",
    "parse_quantization_config",
    "quantize_in_situ",
    "repack_gguf",
    "repack_reader_tensor",
    "select_rows",
    "summarize",
]
