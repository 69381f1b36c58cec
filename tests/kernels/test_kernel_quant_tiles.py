"""The row tiles of 4-bit codes (`kernels.quant_tiles.with_row_tiles`): the same bytes in tiles of 64 or 128
rows x 64 bytes. Every GPU kernel reads it and gives bit for bit what it gives on the row-major layout (same
products, same summation order), so the row-major kernels' references cover it."""

from __future__ import annotations

import pytest
import torch

from kernels.quant_gemm import quant_gemm
from kernels.quant_gemv import quant_gemv
from kernels.quant_gemv_tc import quant_gemv_tc
from kernels.quant_layout import IntPackedWeight, dequantize_int, unpack_codes
from kernels.quant_tiles import row_major_qs, with_row_tiles
from kernels.quant_widen import widen
from tests.kernels.kernel_testlib import DEVICE
from tests.kernels.test_kernel_quant_gemm import fused_case, random_packed

# (N, K) -> the tile rows with_row_tiles picks: 128 where it divides N, else 64
SHAPES = {(256, 384): 128, (192, 512): 64}


def _tiled_pair(n: int, k: int, zeros: bool, perm: bool, seed: int) -> tuple[IntPackedWeight, IntPackedWeight]:
    gen = torch.Generator().manual_seed(seed)
    w = random_packed(n, k, 4, 128, zeros, False, perm, gen)
    return w, with_row_tiles(w)


@pytest.mark.parametrize("shape", SHAPES)
def test_tiles_hold_the_same_codes(shape):
    """Tile t of rows r0..r0+T holds bytes [r0:r0+T, 64 t: 64 t + 64], tiles of a row band in K order."""
    w, tiled = _tiled_pair(*shape, zeros=True, perm=False, seed=1)
    tile_n = SHAPES[shape]
    assert tiled.tile_n == tile_n and tiled.qs.shape == w.qs.shape
    assert torch.equal(tiled.qs.flatten()[:tile_n * 64].view(tile_n, 64), w.qs[:tile_n, :64])
    assert torch.equal(tiled.qs.flatten()[tile_n * 64:2 * tile_n * 64].view(tile_n, 64), w.qs[:tile_n, 64:128])
    assert torch.equal(row_major_qs(tiled), w.qs)
    assert torch.equal(unpack_codes(tiled), unpack_codes(w))
    assert torch.equal(dequantize_int(tiled), dequantize_int(w))
    assert with_row_tiles(tiled) is tiled


@pytest.mark.parametrize("bits,n,k", [(8, 128, 256), (5, 128, 256), (4, 96, 256), (4, 128, 160)])
def test_weights_without_tiles_stay_row_major(bits, n, k):
    """8-bit and 5/6-bit codes, N not a multiple of 64, K not of 128: unchanged."""
    w = random_packed(n, k, bits, 32, False, False, False, torch.Generator().manual_seed(2))
    assert with_row_tiles(w) is w


def test_a_tiled_layout_that_does_not_fit_is_an_error():
    w = random_packed(96, 256, 4, 32, False, False, False, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="tile_n=64"):
        IntPackedWeight(4, 32, w.qs, w.scales, zero=8, tile_n=64)
    with pytest.raises(ValueError, match="tile_n=32"):
        IntPackedWeight(4, 32, w.qs[:64], w.scales[:64], zero=8, tile_n=32)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_rows,split_k", [(1, 1), (1, 2), (5, 1)])
@pytest.mark.parametrize("variant", ["plain", "gated_residual", "norm"])
def test_tensor_core_gemv_reads_tiles(shape, num_rows, split_k, variant):
    n, k = shape
    w, tiled = _tiled_pair(n, k, zeros=variant == "plain", perm=variant == "norm", seed=num_rows + split_k)
    x, bias, norm_w, res, gated = fused_case(variant, num_rows, n, k, torch.Generator().manual_seed(4))
    if variant == "plain":
        x, gated = x[:, :k], False
    outs = [quant_gemv_tc(x, v, bias, gated=gated, norm_weight=norm_w, residual=res, split_k=split_k,
                          block_n=64) for v in (w, tiled)]
    assert torch.equal(outs[0], outs[1])


# (bits, group, zeros, offsets, act-order) as random_packed takes them: GPTQ act-order with zeros, GGUF Q4_K-like
CUDA_CORE_VARIANTS = {"gptq_zeros_actorder": (4, 128, True, False, True), "q4_k_like": (4, 32, False, True, False)}


@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("variant", CUDA_CORE_VARIANTS)
def test_cuda_core_gemv_reads_tiles(num_rows, variant):
    n, k = 256, 384
    w = random_packed(n, k, *CUDA_CORE_VARIANTS[variant], torch.Generator().manual_seed(5))
    tiled = with_row_tiles(w)
    assert tiled.tile_n == 128
    x = torch.randn(num_rows, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(DEVICE)
    for block_k in (128, 512):  # one tile a K step, and four
        outs = [quant_gemv(x, v, block_k=block_k, block_n=None) for v in (w, tiled)]
        assert torch.equal(outs[0], outs[1]), block_k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("variant", CUDA_CORE_VARIANTS)
def test_gemm_and_widen_read_tiles(dtype, variant):
    """The GEMM past 16 rows (bf16 without offsets: codes widened in bf16; else the fp32 planes) and the widened
    weight of prefill chunks."""
    w = random_packed(192, 512, *CUDA_CORE_VARIANTS[variant], torch.Generator().manual_seed(7))
    tiled = with_row_tiles(w)
    assert tiled.tile_n == 64
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    assert torch.equal(quant_gemm(x, w), quant_gemm(x, tiled))
    assert torch.equal(widen(w, dtype), widen(tiled, dtype))
