"""fp8 x fp8 GEMM with per-tensor, per-channel and [128, 128] block scales against float64."""

from __future__ import annotations

import pytest
import torch

from kernels import FP8_DTYPE
from kernels.activation import silu_and_mul
from kernels.fp8_gemm import (
    Fp8Weight,
    dequantize_fp8,
    fp8_gated_linear,
    fp8_gemm,
    fp8_linear,
    fp8_matmul_ref,
    quantize_fp8_groups,
)
from kernels.fp8_gemv import MAX_FP8_GEMV_ROWS, fp8_gemv
from kernels.fp8_quant import quantize_fp8_rows, quantize_fp8_silu_and_mul
from tests.kernels.kernel_testlib import DEVICE, ON_GPU, TOL, rel_err

SCALINGS = {"per_tensor": None, "per_channel": (1, None), "block_128": (128, 128), "block_32": (32, 32)}
SHAPES = [(4096, 4096), (1000, 14336)] if ON_GPU else [(48, 256), (130, 384)]


def random_fp8_weight(n: int, k: int, scaling: str, gen: torch.Generator) -> Fp8Weight:
    block = SCALINGS[scaling] or (n, k)
    block_n, block_k = block[0], block[1] or k
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.rand(-(-n // block_n), -(-k // block_k), generator=gen) * 1e-3 + 1e-4
    return Fp8Weight(q, scale, block_n, block_k).to(DEVICE)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_rows", [1, 7, 33])
def test_fp8_linear_matches_reference(scaling, dtype, num_rows):
    gen = torch.Generator().manual_seed(num_rows + len(scaling))
    for n, k in SHAPES:
        w = random_fp8_weight(n, k, scaling, gen)
        x = torch.randn(num_rows, k, generator=gen).to(dtype=dtype, device=DEVICE)
        bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE) if num_rows > 1 else None
        out = fp8_linear(x, w, bias)
        assert out.dtype == dtype and out.shape == (num_rows, n)
        # NOTE: past MAX_FP8_GEMV_ROWS the product runs on fp8 tensor cores, whose accumulation on Hopper
        # keeps ~14 significant bits, not fp32's (DeepSeek-V3's report): fp32 activations match to that there
        # (H100, 4096 x 4096, 33 rows: 1.3e-4).
        tol = TOL[dtype] if not ON_GPU or num_rows <= MAX_FP8_GEMV_ROWS else max(TOL[dtype], 5e-4)
        assert rel_err(out, fp8_matmul_ref(x, w, bias)) < tol, (scaling, n, k)


def test_fp8_gemv_decodes_every_e4m3_code_exactly():
    """The decode GEMV turns e4m3 bytes into floats by bit arithmetic: every finite code (subnormals,
    both zeros, the largest) must come out as torch's own conversion, exactly."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F / 0xFF: NaN
    q = codes[:, None].expand(-1, 32).contiguous().view(FP8_DTYPE)  # row i: code i, 32 times
    w = Fp8Weight(q, torch.ones(1, 1), q.shape[0], 32).to(DEVICE)
    out = fp8_gemv(torch.ones(1, 32, device=DEVICE), w.weight, w.scale, w.block_n, w.block_k)
    assert torch.equal(out[0].cpu(), 32 * codes.view(FP8_DTYPE).float())


@pytest.mark.parametrize("tile_k", [256, 512])
@pytest.mark.parametrize("n, k", [(40, 640), (24, 1000)], ids=["k_5_blocks", "k_ragged"])
def test_fp8_gemv_tiles_spanning_several_scale_blocks(n, k, tile_k):
    """[128, 128] scales with K tiles of 2 or 4 blocks (the last tile part outside K, the last block partial):
    each block's products take their own scale."""
    gen = torch.Generator().manual_seed(k + tile_k)
    w = random_fp8_weight(n, k, "block_128", gen)
    x = torch.randn(1, k, generator=gen).to(DEVICE)
    out = fp8_gemv(x, w.weight, w.scale, w.block_n, w.block_k, tile_k=tile_k)
    assert rel_err(out, fp8_matmul_ref(x, w)) < TOL[torch.float32]


@pytest.mark.parametrize("num_rows", [1, 5, MAX_FP8_GEMV_ROWS])
def test_fp8_linear_adds_the_residual(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    w = random_fp8_weight(40, 256, "block_32", gen)
    x = torch.randn(num_rows, 256, generator=gen).to(DEVICE)
    res = torch.randn(num_rows, 40, generator=gen).to(DEVICE)
    ref = fp8_matmul_ref(x, w) + res.double()
    assert rel_err(fp8_linear(x, w, residual=res), ref) < TOL[torch.float32]


def test_fp8_quantization_error_against_the_unquantized_matmul():
    """Dynamic per-row activation scales + block weight scales: ~3 mantissa bits each side, averaged."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 256, generator=gen, dtype=torch.float64)
    w16 = torch.randn(64, 256, generator=gen, dtype=torch.float64) * 0.02
    wq, ws = quantize_fp8_groups(w16, 128)  # per-row groups of 128 = blocks (1, 128)
    w = Fp8Weight(wq, ws.float(), 1, 128)
    assert rel_err(dequantize_fp8(w), w16) < 0.05
    assert rel_err(fp8_linear(x.float().to(DEVICE), w.to(DEVICE)).cpu(), x @ w16.T) < 0.06


def test_fp8_arguments_are_checked():
    q = torch.zeros(64, 256, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match=r"scale: expected \(1, 2\) float32"):
        Fp8Weight(q, torch.ones(1, 1), 128, 128)
    with pytest.raises(ValueError, match="weight: expected a 2-D"):
        Fp8Weight(torch.zeros(64, 256), torch.ones(1, 2), 128, 128)
    w = Fp8Weight(q, torch.ones(1, 2), 128, 128).to(DEVICE)
    with pytest.raises(ValueError, match=r"x: expected \[M, 256\]"):
        fp8_linear(torch.randn(2, 128, device=DEVICE), w)
    with pytest.raises(ValueError, match="x_scale: expected"):
        fp8_gemm(q[:2].to(DEVICE), torch.ones(2, 1, device=DEVICE), w)


@pytest.mark.parametrize("rows_cols_group", [(5, 256, 128), (7, 300, 128), (3, 384, 384), (4, 256, 32),
                                             (2, 4096, 4096), (2, 1000, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_activation_quantizer_is_bit_exact(rows_cols_group, dtype):
    """`quantize_fp8_rows` (one launch, what the fp8 GEMMs quantize x with) gives torch's scales and codes bit
    for bit: whole and partial groups, an all-zero group, values in e4m3's subnormal range."""
    m, k, group = rows_cols_group
    gen = torch.Generator().manual_seed(m * k + group)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 10
    x[0, :min(k, group)] = 0.0
    x[1, 3] = x[1].abs().max() * 1e-4  # below e4m3's smallest normal once scaled
    x = x.to(dtype=dtype, device=DEVICE)
    q_ref, scale_ref = quantize_fp8_groups(x, group)
    q, scale = quantize_fp8_rows(x, group)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("rows_cols_group", [(5, 256, 128), (7, 300, 128), (3, 384, 384), (2, 1000, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_silu_and_mul_quantizer_is_the_unfused_pair(rows_cols_group, dtype):
    """`quantize_fp8_silu_and_mul` (the down projection's input in one launch) gives the codes and scales of
    `silu_and_mul` followed by `quantize_fp8_rows` bit for bit: silu(gate) * up rounded to x's dtype first."""
    m, k, group = rows_cols_group
    gen = torch.Generator().manual_seed(m * k + group)
    x = torch.randn(m, 2 * k, generator=gen) * torch.rand(m, 1, generator=gen) * 8
    x[0, :min(k, group)] = 0.0  # an all-zero group of gates
    x = x.to(dtype=dtype, device=DEVICE)
    q_ref, scale_ref = quantize_fp8_rows(silu_and_mul(x), group)
    q, scale = quantize_fp8_silu_and_mul(x, group)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("scaling", ["per_channel", "block_128"])
@pytest.mark.parametrize("num_rows", [1, 9])
def test_gated_linear_is_linear_of_silu_and_mul(scaling, num_rows):
    """The down projection over gate | up equals `fp8_linear(silu_and_mul(x))` exactly (the same quantized x, the
    same GEMM) at the GEMV's row count and past it; a wrong width is a ValueError naming x."""
    gen = torch.Generator().manual_seed(num_rows)
    n, k = SHAPES[0]
    w = random_fp8_weight(n, k, scaling, gen)
    x = torch.randn(num_rows, 2 * k, generator=gen).to(dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(fp8_gated_linear(x, w), fp8_linear(silu_and_mul(x), w))
    with pytest.raises(ValueError, match=r"x: expected \[M, 2K"):
        fp8_gated_linear(x[:, :k], w)
