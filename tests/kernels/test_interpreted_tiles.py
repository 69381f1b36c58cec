"""Under Triton's interpreter the GEMVs launch wide column tiles (`kernels._common.interpreted_block_n`: a launch
costs per program there). Each output column is summed by one program in one order whatever the column tile, so
the results must be bit for bit those of the tiles the GPU takes: the kernels' reference tests, which take the
default (wide) tiles here, then vouch for the GPU's tiles too. Compiled on a GPU both launches take the same tile
(nothing to compare there)."""

from __future__ import annotations

import pytest
import torch

from kernels import gemv
from kernels._common import INTERPRETED_BLOCK_N, interpreted_block_n, is_interpreter
from kernels.fp8_gemv import fp8_gemv, fp8_gemv_config
from kernels.gemv import gemv_config
from kernels.quant_gemv import quant_gemv, quant_gemv_config
from tests.kernels.kernel_testlib import DEVICE
from tests.kernels.test_kernel_fp8_gemm import random_fp8_weight
from tests.kernels.test_kernel_quant_gemm import random_packed

# N past INTERPRETED_BLOCK_N: two wide programs, the second one partial (the GPU's tiles: 9-68 programs); K over
# two K tiles, the second one partial. fp32 activations: a changed summation order shows in the last bits.
SHAPES = [(136, 1280)]


def test_the_interpreter_widens_the_column_tile_only_there():
    assert interpreted_block_n(8, 40) == (64 if is_interpreter() else 8)
    assert interpreted_block_n(8, 136) == (INTERPRETED_BLOCK_N if is_interpreter() else 8)
    assert interpreted_block_n(256, 300) == 256  # never narrower


@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("variant", ["plain", "gated_residual_bias", "norm"])
def test_gemv_takes_the_same_bits_in_either_tile(num_rows, variant):
    gen = torch.Generator().manual_seed(num_rows)
    for n, k in SHAPES:
        gated = "gated" in variant
        x = torch.randn(num_rows, (2 if gated else 1) * k, generator=gen).to(DEVICE)
        w = torch.randn(n, k, generator=gen).to(DEVICE)
        options = {"gated": gated,
                   "bias": torch.randn(n, generator=gen).to(x) if "bias" in variant else None,
                   "norm_weight": torch.rand(k, generator=gen).to(x) + 0.5 if "norm" in variant else None,
                   "residual": torch.randn(num_rows, n, generator=gen).to(x) if "residual" in variant else None}
        gpu_tile = gemv_config(num_rows, n, has_prologue=gated or "norm" in variant)["block_n"]
        assert torch.equal(gemv(x, w, **options), gemv(x, w, block_n=gpu_tile, **options)), (n, k)


@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize("variant", ["gptq_zeros_actorder", "q4_k_like", "int8_channel"])
def test_quant_gemv_takes_the_same_bits_in_either_tile(num_rows, variant):
    bits, group, zeros, offsets, perm = {"gptq_zeros_actorder": (4, 32, True, False, True),
                                         "q4_k_like": (4, 32, False, True, False),
                                         "int8_channel": (8, None, False, False, False)}[variant]
    gen = torch.Generator().manual_seed(7)
    for n, k in SHAPES:
        w = random_packed(n, k, bits, group, zeros, offsets, perm, gen)
        x = torch.randn(num_rows, k, generator=gen).to(DEVICE)
        tiles = quant_gemv_config(n)
        assert torch.equal(quant_gemv(x, w, block_k=tiles["block_k"]),
                           quant_gemv(x, w, block_k=tiles["block_k"], block_n=tiles["block_n"])), (n, k)


@pytest.mark.parametrize("scaling", ["per_channel", "block_32"])
def test_fp8_gemv_takes_the_same_bits_in_either_tile(scaling):
    gen = torch.Generator().manual_seed(11)
    for n, k in SHAPES:
        w = random_fp8_weight(n, k, scaling, gen)
        x = torch.randn(1, k, generator=gen).to(DEVICE)
        gpu_tile = fp8_gemv_config(1, n, is_k_blocked=w.block_k < k)["block_n"]
        assert torch.equal(fp8_gemv(x, w.weight, w.scale, w.block_n, w.block_k),
                           fp8_gemv(x, w.weight, w.scale, w.block_n, w.block_k, tile_n=gpu_tile)), (n, k)
