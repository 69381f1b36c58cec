"""Weight-only quantized GEMV / GEMM against dequantize-then-matmul in float64, over the packed layout's
variants: 4/5/6/8-bit codes, group 16/32/128/per-channel, zeros per group or constant, offsets, act-order."""

from __future__ import annotations

import functools

import pytest
import torch

from kernels.quant_gemm import quant_gemm, quant_matmul
from kernels.quant_gemv import MAX_QUANT_GEMV_ROWS, quant_gemv
from kernels.quant_layout import (
    IntPackedWeight,
    dequantize_int,
    pack_int,
    quant_matmul_ref,
    unpack_codes,
)
from kernels.quant_widen import widen, widened_matmul
from tests.kernels.kernel_testlib import DEVICE, ON_GPU, TOL, poisoned, rel_err

# name: (bits, group_size or None = per channel, per-group zeros, offsets, act-order permutation)
VARIANTS = {
    "gptq_g128_actorder": (4, 128, True, False, True),
    "awq_g128": (4, 128, True, False, False),
    "int4_per_channel": (4, None, False, False, False),
    "q4_1_g32": (4, 32, False, True, False),
    "int4_g16_offsets": (4, 16, True, True, False),  # lo and hi nibbles of a byte in different groups
    "q5_k_g32": (5, 32, False, True, False),
    "q6_k_g16": (6, 16, False, False, False),
    "int8_per_channel": (8, None, False, False, False),
    "q8_0_g32": (8, 32, False, False, False),
    "q6_k_as_bytes": (8, 16, False, False, False),  # GGUF Q6_K / Q5_K codes held one a byte (the GPU loader's)
    "q5_k_as_bytes": (8, 32, False, True, False),
}
SHAPES = [(4096, 4096), (1000, 14336)] if ON_GPU else [(40, 256), (19, 384)]


def random_packed(n: int, k: int, bits: int, group: int | None, has_zeros: bool, has_offsets: bool,
                  has_perm: bool, gen: torch.Generator, scale_dtype=torch.float16) -> IntPackedWeight:
    group = group or k
    num_groups = k // group
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = (torch.rand(n, num_groups, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    zeros = torch.randint(0, 1 << bits, (n, num_groups), generator=gen) if has_zeros else None
    offsets = (torch.randn(n, num_groups, generator=gen) * 0.05).to(scale_dtype) if has_offsets else None
    perm = torch.randperm(k, generator=gen).to(torch.int32) if has_perm else None
    return pack_int(codes, bits, group, scales, zeros=zeros, zero=1 << (bits - 1), offsets=offsets,
                    perm=perm).to(DEVICE)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pack_roundtrip_and_dequantize(variant):
    bits, group, *_ = VARIANTS[variant]
    gen = torch.Generator().manual_seed(1)
    n, k = 6, 256
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen)
    scales = torch.rand(n, k // (group or k), generator=gen).to(torch.float16)
    w = pack_int(codes, bits, group or k, scales, zero=3)
    assert torch.equal(unpack_codes(w), codes.to(torch.int32))
    expected = scales.double().repeat_interleave(group or k, 1) * (codes.double() - 3)
    assert torch.equal(dequantize_int(w, torch.float64), expected)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_rows", [1, 3, MAX_QUANT_GEMV_ROWS, 40, 130])
def test_quant_matmul_matches_dequantized_reference(variant, dtype, num_rows):
    """Rows 1..2 take the GEMV, more the tensor-core GEMM (3..16: a dot per nibble plane; 40, 130: one dot in K
    order, 4-bit codes without offsets dequantized in fp16 / bf16); all against float64 dequantize-then-matmul."""
    gen = torch.Generator().manual_seed(num_rows * 31 + len(variant))
    for n, k in SHAPES:
        w = random_packed(n, k, *VARIANTS[variant], gen)
        x = torch.randn(num_rows, k, generator=gen).to(dtype=dtype, device=DEVICE)
        bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE) if num_rows % 2 else None
        out = poisoned((num_rows, n), dtype)
        quant_matmul(x, w, bias, out=out)
        assert rel_err(out, quant_matmul_ref(x, w, bias)) < TOL[dtype], (variant, n, k)


@pytest.mark.parametrize("launch", [quant_gemv, quant_gemm, functools.partial(quant_gemm, natural=True),
                                    functools.partial(quant_gemm, natural=False)],
                         ids=["gemv", "gemm", "gemm_k_order", "gemm_planes"])
def test_both_kernels_take_any_row_count(launch):
    """Either kernel is correct at any M (the entry point's split is a speed choice only)."""
    gen = torch.Generator().manual_seed(5)
    w = random_packed(24, 128, 4, 32, True, False, False, gen)
    for num_rows in (1, 5, 20):
        x = torch.randn(num_rows, 128, generator=gen).to(device=DEVICE)
        assert rel_err(launch(x, w), quant_matmul_ref(x, w)) < TOL[torch.float32]


def test_byte_codes_stay_on_the_gemv_to_four_rows(monkeypatch):
    """`quant_matmul` sends 8-bit codes to the GEMV up to 4 rows and other codes up to 2 (the crossover measured per
    format); the GEMM past that."""
    import kernels.quant_gemm as quant_gemm_module

    gen = torch.Generator().manual_seed(6)
    calls = []
    for name in ("gemv", "gemm"):
        kernel = getattr(quant_gemm_module, f"quant_{name}")
        monkeypatch.setattr(quant_gemm_module, f"quant_{name}",
                            lambda *a, kernel=kernel, name=name, **kw: calls.append(name) or kernel(*a, **kw))
    for variant, rows in (("q8_0_g32", 4), ("q8_0_g32", 5), ("q4_1_g32", 2), ("q4_1_g32", 3)):
        w = random_packed(16, 64, *VARIANTS[variant], gen)
        x = torch.randn(rows, 64, generator=gen).to(device=DEVICE)
        assert rel_err(quant_matmul(x, w), quant_matmul_ref(x, w)) < TOL[torch.float32]
    assert calls == ["gemv", "gemm", "gemv", "gemm"]


def test_fp32_scales_and_strided_rows():
    """K-quant scales are fp32 products; x may be a row-strided view (a slice of a wider tensor)."""
    gen = torch.Generator().manual_seed(9)
    w = random_packed(33, 256, 5, 32, False, True, False, gen, scale_dtype=torch.float32)
    wide = torch.randn(4, 300, generator=gen).to(device=DEVICE)
    x = wide[:, :256]
    assert rel_err(quant_matmul(x, w), quant_matmul_ref(x, w)) < TOL[torch.float32]


def test_layout_and_arguments_are_checked():
    gen = torch.Generator().manual_seed(2)
    w = random_packed(8, 64, 4, 32, False, False, False, gen)
    with pytest.raises(ValueError, match=r"x: expected \[M, 64\]"):
        quant_matmul(torch.randn(2, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="bias: expected"):
        quant_matmul(torch.randn(2, 64, device=DEVICE), w, torch.randn(7, device=DEVICE))
    with pytest.raises(ValueError, match="x: dtype"):
        quant_matmul(torch.ones(2, 64, dtype=torch.int32, device=DEVICE), w)
    with pytest.raises(ValueError, match="qs: expected shape"):
        IntPackedWeight(4, 32, torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="qh: expected shape"):
        IntPackedWeight(5, 32, torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="codes outside 0..15"):
        pack_int(torch.full((2, 32), 16), 4, 32, torch.ones(2, 1))


def fused_case(variant: str, num_rows: int, n: int, k: int, gen: torch.Generator) -> tuple:
    """(x, bias, norm_weight, residual, gated) of a fused decoder call named like "bias_norm_residual", bf16."""
    gated, has_bias, has_norm, has_res = (word in variant for word in ("gated", "bias", "norm", "residual"))
    x = (3 * torch.randn(num_rows, (2 if gated else 1) * k, generator=gen)).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEVICE) if has_bias else None
    norm_w = (1 + 0.3 * torch.randn(k, generator=gen)).to(torch.bfloat16).to(DEVICE) if has_norm else None
    res = torch.randn(num_rows, n, generator=gen).to(torch.bfloat16).to(DEVICE) if has_res else None
    return x, bias, norm_w, res, gated


@pytest.mark.parametrize("variant", ["gated_residual", "norm", "bias_norm_residual"])
@pytest.mark.parametrize("num_rows", [1, 4, MAX_QUANT_GEMV_ROWS])
def test_fused_decoder_options(variant, num_rows, monkeypatch):
    """The decoder's fusions as `gemv` has them: down (gated, residual), qkv / gate_up (norm, bias), o (residual);
    on the CUDA cores (the tensor-core GEMV's own test covers it)."""
    monkeypatch.setattr("kernels.quant_gemv.TENSOR_CORES", False)
    gen = torch.Generator().manual_seed(num_rows + 3 * len(variant))
    for n, k in SHAPES:
        w = random_packed(n, k, *VARIANTS["gptq_g128_actorder" if "norm" in variant else "q4_1_g32"], gen)
        x, bias, norm_w, res, gated = fused_case(variant, num_rows, n, k, gen)
        out = poisoned((num_rows, n), torch.bfloat16)
        quant_matmul(x, w, bias, gated=gated, norm_weight=norm_w, eps=1e-5, residual=res, out=out)
        ref = quant_matmul_ref(x, w, bias, gated, norm_w, 1e-5, res)
        assert rel_err(out, ref) < TOL[torch.bfloat16], (variant, n, k)


def test_fused_options_are_decode_only():
    gen = torch.Generator().manual_seed(8)
    w = random_packed(8, 64, 4, 32, False, False, False, gen)
    with pytest.raises(ValueError, match=r"x: 1..16 rows with gated / norm_weight / residual, got 17"):
        quant_matmul(torch.randn(17, 64, device=DEVICE), w, residual=torch.randn(17, 8, device=DEVICE))
    with pytest.raises(ValueError, match=r"x: expected \[M, 2K = 128\]"):
        quant_matmul(torch.randn(2, 64, device=DEVICE), w, gated=True)
    with pytest.raises(ValueError, match="norm_weight: expected"):
        quant_matmul(torch.randn(2, 64, device=DEVICE), w, norm_weight=torch.ones(63, device=DEVICE))


@pytest.mark.parametrize("variant", VARIANTS)
def test_widened_weight_and_matmul(variant):
    """`widen` gives the dequantized weight in packed column order (fp32: the formula's own rounding; fp16 /
    bf16: rounded once more at most); `widened_matmul` (quant_matmul's path from WIDEN_ROWS rows on the GPU)
    equals the float64 reference, act-order included."""
    gen = torch.Generator().manual_seed(len(variant) * 7)
    n, k = SHAPES[0]
    w = random_packed(n, k, *VARIANTS[variant], gen)
    expected = dequantize_int(w, torch.float32, unpermute=False)
    assert torch.allclose(widen(w, torch.float32), expected, rtol=1e-6, atol=1e-7)
    for dtype in (torch.bfloat16, torch.float16):
        eps = torch.finfo(dtype).eps
        assert torch.allclose(widen(w, dtype).float(), expected, rtol=2 * eps, atol=1e-6), (variant, dtype)
        x = torch.randn(20, k, generator=gen).to(dtype=dtype, device=DEVICE)
        bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE)
        out = poisoned((20, n), dtype)
        widened_matmul(x, w, bias, out=out)
        assert rel_err(out, quant_matmul_ref(x, w, bias)) < TOL[dtype], (variant, dtype)
