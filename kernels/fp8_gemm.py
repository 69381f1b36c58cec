"""fp8 x fp8 matmul with scales: y = (x_q * x_scale) @ (w_q * w_scale).T, for FP8 checkpoints; decode
rows (up to MAX_FP8_GEMV_ROWS) go to the weight-only `fp8_gemv` instead. `fp8_gated_linear` (the gated MLP's
down projection) and `fp8_normed_linear` (a projection after an RMSNorm) quantize their input in the launch that
computes it.

The weight is e4m3 [N, K] with one fp32 scale per [block_n, block_k] block: per tensor (N, K), per
output channel (1, K) or block-wise (128, 128: DeepSeek-V3 / Qwen3-*-FP8 `weight_scale_inv`). The
activations are quantized at run time to e4m3 with one scale per row and block_k columns
(`kernels.fp8_quant.quantize_fp8_rows`), so every K tile of the Triton kernel has one scale per row of x and one per
block of w: it accumulates each tile's fp8 dot in fp32 and adds it scaled by their product.
Per-tensor and per-channel weights on a CUDA device go to torch's `_scaled_mm` (cuBLASLt) instead, with fast
accumulation (the tensor cores' fp8 accumulator, not promoted to fp32 every few K steps), as vLLM's and
TensorRT-LLM's Hopper fp8 GEMMs run: a layer's projections 5-16% faster (H100, H200; bench/fp8_prefill_gemm.py
reports its error beside the promoted form's). `KERNELS_FP8_FAST_ACCUM=0` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._common import (
    ACT_DTYPES,
    FP8_DTYPE,
    FP8_MAX,
    cast,
    dot_upcast,
    is_interpreter,
    pdl_args,
    pdl_enter,
    require,
    require_dtype,
    require_inner_contiguous,
)
from kernels.activation import silu_and_mul
from kernels.fp8_gemv import MAX_FP8_GEMV_ROWS, fp8_gemv
from kernels.fp8_quant import MIN_SCALE, quantize_fp8_rows, quantize_fp8_silu_and_mul
from kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8


@dataclass
class Fp8Weight:
    """An [N, K] e4m3 weight with `scale` [ceil(N / block_n), ceil(K / block_k)] float32 multipliers."""

    weight: torch.Tensor
    scale: torch.Tensor
    block_n: int
    block_k: int

    def __post_init__(self) -> None:
        if self.weight.dim() != 2 or self.weight.dtype != FP8_DTYPE:
            raise ValueError(f"weight: expected a 2-D {FP8_DTYPE} tensor, got {tuple(self.weight.shape)} {self.weight.dtype}")
        n, k = self.weight.shape
        expected = (triton.cdiv(n, self.block_n), triton.cdiv(k, self.block_k))
        if tuple(self.scale.shape) != expected or self.scale.dtype != torch.float32:
            raise ValueError(f"scale: expected {expected} float32 for blocks ({self.block_n}, {self.block_k}) of "
                             f"[{n}, {k}], got {tuple(self.scale.shape)} {self.scale.dtype}")
        if self.block_k != k and self.block_k % 16:
            raise ValueError(f"block_k: a multiple of 16 (or K), got {self.block_k}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    @property
    def is_block_wise(self) -> bool:
        return self.block_k != self.weight.shape[1]

    def to(self, device: torch.device | str) -> Fp8Weight:
        return Fp8Weight(self.weight.to(device), self.scale.to(device), self.block_n, self.block_k)


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, cdiv(K, group)]): each row's groups of `group`
    columns (the last one may be partial) scaled so their largest magnitude is FP8_MAX (dynamic
    quantization; the reference of `kernels.fp8_quant.quantize_fp8_rows`, which quantizes activations)."""
    m, k = x.shape
    num_groups = triton.cdiv(k, group)
    padded = torch.nn.functional.pad(x.float(), (0, num_groups * group - k))
    groups = padded.view(m, num_groups, group)
    amax = groups.abs().amax(-1)
    # NOTE: a tensor divisor, not the number: CUDA torch divides by a scalar as a multiply by its reciprocal
    # (an ulp off IEEE division at times), and the Triton quantizer divides as IEEE does on every device.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, -1)[:, :k].contiguous(), scale


def dequantize_fp8(w: Fp8Weight, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The weight [N, K] in `dtype`: each block times its scale."""
    n, k = w.shape
    scale = w.scale.to(dtype).repeat_interleave(w.block_n, 0)[:n].repeat_interleave(w.block_k, 1)[:, :k]
    return w.weight.to(dtype) * scale


def fp8_matmul_ref(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 reference of `fp8_linear`: x as the kernel takes it (quantized to e4m3 past
    MAX_FP8_GEMV_ROWS rows, as it is up to them), the weight dequantized."""
    if x.shape[0] > MAX_FP8_GEMV_ROWS:
        xq, xs = quantize_fp8_groups(x, w.block_k)
        x = xq.double() * xs.double().repeat_interleave(w.block_k, 1)[:, :x.shape[1]]
    y = x.double() @ dequantize_fp8(w).T
    return y if bias is None else y + bias.double()


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] e4m3
    as_ptr,  # [M, K / GROUP_K] float32
    b_ptr,  # [N, K] e4m3
    bs_ptr,  # [cdiv(N, GROUP_N), cdiv(K, GROUP_K)] float32
    bias_ptr,  # [N], or any pointer when not HAS_BIAS
    y_ptr,  # [M, N]
    M, N, K, stride_am, stride_as, stride_bn, stride_bs, stride_ym,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_rows = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a = tl.load(a_rows + k[None, :], mask=mask_m[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(b_rows + k[None, :], mask=mask_n[:, None] & (k[None, :] < K), other=0.0)
        if UPCAST:
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(a, tl.trans(b))
        a_s = tl.load(as_ptr + offs_m * stride_as + k0 // GROUP_K, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptr + (offs_n // GROUP_N) * stride_bs + k0 // GROUP_K, mask=mask_n, other=0.0)
        acc += part * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], cast(acc, y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *,
             out_dtype: torch.dtype = torch.bfloat16, block_m: int | None = None, block_n: int = 128,
             num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """Triton fp8 GEMM: xq [M, K] e4m3 with x_scale [M, K / block_k] against `w` -> [M, N] out_dtype."""
    m, k = xq.shape
    n = w.shape[0]
    require(tuple(x_scale.shape) == (m, triton.cdiv(k, w.block_k)), lambda: f"x_scale: expected {(m, triton.cdiv(k, w.block_k))}")
    block_k = min(128, w.block_k & -w.block_k)  # the largest power of two dividing the scale group
    require(block_k >= 16, lambda: f"block_k {w.block_k}: a multiple of 16 expected")
    block_m = block_m or (16 if m <= 16 else 64)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    opts = {} if is_interpreter() else {"num_warps": num_warps, "num_stages": num_stages}
    _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        xq, x_scale, w.weight, w.scale, bias if bias is not None else out, out, m, n, k, xq.stride(0),
        x_scale.stride(0), w.weight.stride(0), w.scale.stride(0), out.stride(0), GROUP_N=w.block_n,
        GROUP_K=w.block_k, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=dot_upcast(), **opts, **pdl_args(xq.device))
    return out


# NOTE: read once at import (the engine captures CUDA graphs of these calls).
_FAST_ACCUM = os.environ.get("KERNELS_FP8_FAST_ACCUM", "1") != "0"


def _can_scaled_mm(xq: torch.Tensor, out_dtype: torch.dtype, w: Fp8Weight) -> bool:
    # NOTE: cuBLASLt's fp8 GEMM takes per-tensor or per-row/column scales only, and row-wise scales
    # only with a bf16 output; dims must be multiples of 16.
    n, k = w.shape
    return (xq.is_cuda and not is_interpreter() and hasattr(torch, "_scaled_mm") and not w.is_block_wise
            and out_dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (16/32-bit) @ dequant(w).T + bias (+ residual [M, N]) -> [M, N] in x's dtype, fp32
    accumulation. Up to MAX_FP8_GEMV_ROWS rows (decode) x stays as it is (`fp8_gemv`); past them it is
    quantized to e4m3 per row and block_k columns for the fp8 x fp8 GEMM."""
    n, k = w.shape
    require(x.dim() == 2 and x.shape[1] == k, lambda: f"x: expected [M, {k}], got {tuple(x.shape)}")
    require_dtype("x", x, ACT_DTYPES)
    require_inner_contiguous("x", x)
    require(bias is None or tuple(bias.shape) == (n,), lambda: f"bias: expected [{n}], got {None if bias is None else tuple(bias.shape)}")
    require(residual is None or tuple(residual.shape) == (x.shape[0], n),
            lambda: f"residual: expected {[x.shape[0], n]}, got {None if residual is None else list(residual.shape)}")
    if x.shape[0] <= MAX_FP8_GEMV_ROWS:
        return fp8_gemv(x, w.weight, w.scale, w.block_n, w.block_k, bias, residual=residual)
    y = fp8_quantized_matmul(x, w, bias)
    return y if residual is None else y.add_(residual)


def fp8_quantized_matmul(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The path past MAX_FP8_GEMV_ROWS rows (any row count): x quantized to e4m3 per row and block_k
    columns (`kernels.fp8_quant`, one launch), then `fp8_matmul_quantized`."""
    xq, x_scale = quantize_fp8_rows(x, w.block_k)
    return fp8_matmul_quantized(xq, x_scale, w, bias, out_dtype=x.dtype)


def fp8_gated_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear(silu_and_mul(x), w, bias)` for the gated MLP's down projection, x [M, 2K] (gate then up):
    past MAX_FP8_GEMV_ROWS rows silu(gate) * up is quantized in the launch that computes it
    (`quantize_fp8_silu_and_mul`, the same codes and scales), so its 16-bit copy is never written or read."""
    n, k = w.shape
    require(x.dim() == 2 and x.shape[1] == 2 * k, lambda: f"x: expected [M, 2K = {2 * k}], got {tuple(x.shape)}")
    require_dtype("x", x, ACT_DTYPES)
    if x.shape[0] <= MAX_FP8_GEMV_ROWS:
        return fp8_linear(silu_and_mul(x), w, bias)
    xq, x_scale = quantize_fp8_silu_and_mul(x, w.block_k)
    return fp8_matmul_quantized(xq, x_scale, w, bias, out_dtype=x.dtype)


def fp8_normed_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear(rms_norm(x), w, bias)`, or with a residual `fp8_linear(fused_add_rms_norm(x, residual), ..)`
    (the residual updated in place to x + residual; x may be overwritten): an fp8 projection after a norm. Past
    MAX_FP8_GEMV_ROWS rows the normed rows are quantized in the norm's launch (`norm.rms_norm_fp8`, the same codes
    and scales) when the weight has one scale a row of x, so their 16-bit copy is never written or read."""
    if x.shape[0] > MAX_FP8_GEMV_ROWS and w.block_k >= w.shape[1]:  # one scale a row of x: see rms_norm_fp8
        xq, x_scale = rms_norm_fp8(x, residual, norm_weight, eps)
        return fp8_matmul_quantized(xq, x_scale, w, bias, out_dtype=x.dtype)
    normed = rms_norm(x, norm_weight, eps) if residual is None else fused_add_rms_norm(x, residual, norm_weight, eps)
    return fp8_linear(normed, w, bias)


def fp8_matmul_quantized(xq: torch.Tensor, x_scale: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """(xq * x_scale) @ dequant(w).T + bias -> [M, N] in out_dtype, xq e4m3 with scales [M, cdiv(K, block_k)]:
    cuBLASLt's `_scaled_mm` where it applies, else the Triton fp8 GEMM."""
    n = w.shape[0]
    if _can_scaled_mm(xq, out_dtype, w):
        scale_b = w.scale.view(1, -1) if w.scale.numel() > 1 else w.scale.view(1, 1)
        scale_b = scale_b.expand(1, n).contiguous() if scale_b.shape[1] == 1 else scale_b
        return torch._scaled_mm(xq, w.weight.t(), scale_a=x_scale, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=_FAST_ACCUM)
    return fp8_gemm(xq, x_scale, w, bias, out_dtype=out_dtype)
