"""SiLU-and-mul against the float64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_testlib import DEVICE, DTYPE_IDS, ON_GPU, TOL, poisoned, rel_err

from kernels import silu_and_mul, silu_and_mul_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
GRID = list(itertools.product((1, 80, 1000, 1536, 14336) if ON_GPU else (1, 80, 1500), (1, 7, 64), (F32, F16, BF16)))


@pytest.mark.parametrize("d,rows,dtype", GRID, ids=[f"d{d}-t{t}-{DTYPE_IDS[x]}" for d, t, x in GRID])
def test_silu_and_mul(d, rows, dtype):
    x = (3 * torch.randn(rows, 2 * d, device=DEVICE)).to(dtype)
    out = poisoned((rows, d), dtype)
    silu_and_mul(x, out=out)
    assert rel_err(out, silu_and_mul_ref(x)) <= TOL[dtype]


def test_silu_and_mul_strided_input_and_checks():
    big = torch.randn(4, 300, device=DEVICE)
    x = big[:, :160]
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) <= TOL[F32]
    with pytest.raises(ValueError, match="2 \\* d"):
        silu_and_mul(torch.randn(3, 7, device=DEVICE))
    with pytest.raises(ValueError, match="out"):
        silu_and_mul(x, out=torch.empty(4, 81, device=DEVICE))
