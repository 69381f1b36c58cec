"""The tensor-core batch GEMM for 4-bit codes (`kernels.quant_gemm_tc`, the weight as the MMA's left operand)
against matmuls in float64: the weight it computes (scale rounded to x's dtype, times q - zero, rounded once)
exactly, then fp32 sums; constant and per-group zeros, act-order, per-channel scales, row tiles, bias, rows
and weight rows past the tiles; and which row counts `quant_matmul` sends it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.quant_gemm import quant_matmul
from kernels.quant_gemm_tc import quant_gemm_tc, takes_gemm_tensor_cores
from kernels.quant_layout import dequantize_int, quant_matmul_ref
from kernels.quant_tiles import with_row_tiles
from tests.kernels.kernel_testlib import DEVICE, ON_GPU, TOL, poisoned, rel_err
from tests.kernels.test_kernel_quant_gemm import random_packed
from tests.kernels.test_kernel_quant_gemv_tc import OUT_TOL, VARIANTS

GEMM_VARIANTS = [v for v in VARIANTS if VARIANTS[v][1] is None or VARIANTS[v][1] >= 64]
SHAPES = [(4096, 4096), (1000, 14336)] if ON_GPU else [(72, 512), (264, 256)]


def rounded_weight_ref(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 x @ W^T (+ bias) with W as the kernel widens it: round(round(scale) * (q - zero)) in x's dtype."""
    rounded = dataclasses.replace(w, scales=w.scales.to(x.dtype).to(w.scales.dtype))
    weight = dequantize_int(rounded, torch.float32).to(x.dtype).double()  # the product is exact in fp32
    out = x.double() @ weight.T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("variant", GEMM_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_rows", [17, 70])
@pytest.mark.parametrize("tiled", [False, True], ids=["row_major", "row_tiles"])
def test_matches_the_rounded_weights_matmul(variant, dtype, num_rows, tiled):
    """fp32 sums of the weights it rounds: the error is the output's rounding (a wrong nibble, zero, group or
    column is ~1); against the unrounded weights, the usual half-precision tolerance."""
    gen = torch.Generator().manual_seed(num_rows + len(variant) + tiled)
    for n, k in SHAPES:
        w = random_packed(n, k, *VARIANTS[variant], gen)
        w = with_row_tiles(w) if tiled else w
        assert takes_gemm_tensor_cores(w) and (w.tile_n > 0) == (tiled and n % 64 == 0)
        x = torch.randn(num_rows, k, generator=gen).to(dtype=dtype, device=DEVICE)
        bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE) if num_rows == 17 else None
        out = poisoned((num_rows, n), dtype)
        quant_gemm_tc(x, w, bias, out=out, block_m=64)
        assert rel_err(out, rounded_weight_ref(x, w, bias)) < OUT_TOL[dtype], (variant, n, k)
        assert rel_err(out, quant_matmul_ref(x, w, bias)) < TOL[dtype], (variant, n, k)


def test_groups_of_32_stay_on_the_other_gemm():
    gen = torch.Generator().manual_seed(5)
    w = random_packed(64, 256, *VARIANTS["q4_0_g32"], gen)
    assert not takes_gemm_tensor_cores(w)
    x = torch.randn(40, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert rel_err(quant_matmul(x, w), quant_matmul_ref(x, w)) < TOL[torch.bfloat16]


def test_quant_matmul_sends_it_the_rows_past_the_gemv():
    """17..WIDEN_ROWS - 1 rows of a weight it takes: the same bits as calling it."""
    gen = torch.Generator().manual_seed(6)
    w = random_packed(72, 512, *VARIANTS["awq_g128"], gen)
    for num_rows in (17, 33):
        x = torch.randn(num_rows, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
        assert torch.equal(quant_matmul(x, w), quant_gemm_tc(x, w))
