"""The tensor-core fp8 decode GEMV (`kernels.fp8_gemv_tc`) against dequantize-then-matmul in float64: every e4m3
code, per-tensor / per-channel / block scales, 16-bit rows of any magnitude (each K step's power-of-two scaling),
split K, bias and residual; and which calls `fp8_linear` sends it."""

from __future__ import annotations

import pytest
import torch

from kernels import FP8_DTYPE
from kernels.fp8_gemm import Fp8Weight, dequantize_fp8, fp8_linear
from kernels.fp8_gemv import fp8_gemv
from kernels.fp8_gemv_tc import fp8_gemv_tc, takes_fp8_tensor_cores
from kernels.split_k import _WORKSPACES
from tests.kernels.kernel_testlib import DEVICE, ON_GPU, poisoned, rel_err
from tests.kernels.test_kernel_fp8_gemm import SCALINGS, random_fp8_weight

SHAPES = [(4096, 4096), (1024, 14336)] if ON_GPU else [(72, 256), (130, 384)]
# the output's rounding alone: half an ulp of bf16 / fp16, relative, with room for fp32 summation order
OUT_TOL = {torch.bfloat16: 3e-3, torch.float16: 5e-4}


def call(x: torch.Tensor, w: Fp8Weight, bias=None, **kwargs) -> torch.Tensor:
    return fp8_gemv_tc(x, w.weight, w.scale, w.block_n, w.block_k, bias, **kwargs)


def weight_only_ref(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 x @ dequant(w).T (+ bias): x as it is, on every row (`fp8_matmul_ref` quantizes x past one row,
    as the fp8 x fp8 GEMM does)."""
    y = x.double() @ dequantize_fp8(w).T
    return y if bias is None else y + bias.double()


def test_every_e4m3_code_widens_exactly():
    """Row i holds code i 32 times; x is ones: out[i] = 32 x the code's value, rounded once to bf16."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F / 0xFF: NaN
    q = codes[:, None].expand(-1, 32).contiguous().view(FP8_DTYPE)
    w = Fp8Weight(q, torch.ones(1, 1), q.shape[0], 32).to(DEVICE)
    out = call(torch.ones(1, 32, dtype=torch.bfloat16, device=DEVICE), w)
    assert torch.equal(out[0].cpu(), (32 * codes.view(FP8_DTYPE).float()).to(torch.bfloat16))


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_rows,split_k", [(1, 1), (1, 2), (5, 4), (16, 1)])
def test_matches_dequantized_reference(scaling, dtype, num_rows, split_k):
    """Exact products, fp32 sums: the error is the output's rounding (a wrong code, scale or block is ~1)."""
    gen = torch.Generator().manual_seed(num_rows * 3 + split_k + len(scaling))
    for n, k in SHAPES:
        w = random_fp8_weight(n, k, scaling, gen)
        x = torch.randn(num_rows, k, generator=gen).to(dtype=dtype, device=DEVICE)
        bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE) if num_rows == 5 else None
        assert takes_fp8_tensor_cores(x, k, w.block_k)
        out = poisoned((num_rows, n), dtype)
        call(x, w, bias, out=out, split_k=split_k)
        assert rel_err(out, weight_only_ref(x, w, bias)) < OUT_TOL[dtype], (scaling, n, k)


def test_rows_of_any_magnitude_keep_their_bits():
    """Each K step scales each row of x by its own power of two before the fp16 products: rows far above fp16's
    range, far below it, spanning 2**40 inside one tile, and zeros all come out as the float64 reference."""
    gen = torch.Generator().manual_seed(9)
    w = random_fp8_weight(72, 256, "per_channel", gen)
    x = torch.randn(4, 256, generator=gen)
    x[0] *= 1e30
    x[1] *= 1e-30
    x[2, ::2] *= 2.0**20
    x[2, 1::2] *= 2.0**-20
    x[3] = 0.0
    x = x.to(torch.bfloat16).to(DEVICE)
    out = call(x, w)
    ref = weight_only_ref(x, w)
    for row in range(3):
        assert rel_err(out[row:row + 1], ref[row:row + 1]) < OUT_TOL[torch.bfloat16], row
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_residual_and_split_k_repeat_exactly_and_leave_the_workspace_zeroed():
    gen = torch.Generator().manual_seed(4)
    w = random_fp8_weight(130, 384, "block_32", gen)
    x = torch.randn(3, 384, generator=gen).to(torch.bfloat16).to(DEVICE)
    res = torch.randn(3, 130, generator=gen).to(torch.bfloat16).to(DEVICE)
    first = call(x, w, residual=res, split_k=4)
    ws, counts = _WORKSPACES[x.device]
    assert not ws.any() and not counts.any()
    assert torch.equal(call(x, w, residual=res, split_k=4), first)
    assert rel_err(first, weight_only_ref(x, w) + res.double()) < OUT_TOL[torch.bfloat16]


def test_fp8_linear_sends_it_one_16_bit_row():
    gen = torch.Generator().manual_seed(5)
    w = random_fp8_weight(72, 256, "block_128", gen)
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(fp8_linear(x, w), call(x, w))
    x32 = x.float()  # float32 rows (the CPU's) stay on the CUDA-core GEMV
    assert not takes_fp8_tensor_cores(x32, 256, 128)
    assert torch.equal(fp8_linear(x32, w), fp8_gemv(x32, w.weight, w.scale, w.block_n, w.block_k))
    assert not takes_fp8_tensor_cores(x[:, :200], 200, 200)  # K not a multiple of 16
