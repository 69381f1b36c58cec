"""Triton kernels for the GPU path, each with a plain torch `*_ref` used by its tests.

KV cache layout per layer: k_cache, v_cache each [num_blocks, block_size, num_kv_heads, head_dim],
in the activation dtype or fp8 e4m3 (`FP8_DTYPE`) with a per-layer scale. See kernels/README.md.
"""

from kernels._common import FP8_DTYPE, FP8_MAX
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.attention_ref import paged_decode_attention_ref
from kernels.decode_attention import DecodeLaunch, decode_launch_variants, paged_decode_attention
from kernels.decode_prologue import DecodeAppend
from kernels.fp8_gemm import Fp8Weight, fp8_gated_linear, fp8_linear, fp8_matmul_ref, fp8_normed_linear
from kernels.gemv import MAX_GEMV_ROWS, gemv, gemv_ref
from kernels.kv_write import quantize_fp8_ref, write_kv_cache, write_kv_cache_ref
from kernels.moe import align_pairs_by_expert, fused_moe, fused_moe_ref
from kernels.moe_route import moe_route
from kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8, rms_norm_ref
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from kernels.quant_gemm import quant_matmul
from kernels.quant_layout import IntPackedWeight, dequantize_int, quant_matmul_ref
from kernels.rotary import Rotary, apply_rotary, rotary_ref
from kernels.split_kv import choose_num_kv_splits

__all__ = [
    "DecodeAppend",
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Weight",
    "IntPackedWeight",
    "MAX_GEMV_ROWS",
    "Rotary",
    "apply_rotary",
    "choose_num_kv_splits",
    "dequantize_int",
    "fp8_gated_linear",
    "fp8_linear",
    "fp8_matmul_ref",
    "fp8_normed_linear",
    "align_pairs_by_expert",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_moe_ref",
    "gemv",
    "gemv_ref",
    "moe_route",
    "paged_decode_attention",
    "DecodeLaunch",
    "decode_launch_variants",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "quant_matmul",
    "quant_matmul_ref",
    "quantize_fp8_ref",
    "rms_norm",
    "rms_norm_fp8",
    "rms_norm_ref",
    "rotary_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "write_kv_cache",
    "write_kv_cache_ref",
]
