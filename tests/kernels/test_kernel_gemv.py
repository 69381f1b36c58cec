"""The decode skinny matmul against a float64 reference: rows 1-4, bias, the fused silu gate, ragged K/N."""

from __future__ import annotations

import pytest
import torch

from kernels import MAX_GEMV_ROWS, gemv, gemv_ref
from tests.kernels.kernel_testlib import DEVICE, ON_GPU, TOL, poisoned, rel_err

# (N, K): ragged sizes on the CPU interpreter, model-sized ones compiled on a GPU.
SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (1000, 576)] if ON_GPU else [(40, 96), (37, 64), (16, 1100)]


@pytest.mark.parametrize("num_rows", range(1, MAX_GEMV_ROWS + 1))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["plain", "bias", "gated", "norm", "bias_norm", "gated_residual", "norm_residual"])
def test_gemv_matches_reference(num_rows, dtype, variant):
    """Each fusion the decoder uses: qkv (bias, norm), o (residual), gate_up (norm), down (gated, residual)."""
    gated, has_bias, has_norm, has_res = ("gated" in variant, "bias" in variant, "norm" in variant, "residual" in variant)
    gen = torch.Generator().manual_seed(num_rows * 7 + len(variant))
    for n, k in SHAPES:
        x = (3 * torch.randn(num_rows, (2 if gated else 1) * k, generator=gen)).to(dtype=dtype, device=DEVICE)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype=dtype, device=DEVICE)
        bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE) if has_bias else None
        norm_w = (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype=dtype, device=DEVICE) if has_norm else None
        res = torch.randn(num_rows, n, generator=gen).to(dtype=dtype, device=DEVICE) if has_res else None
        out = poisoned((num_rows, n), dtype)
        gemv(x, w, bias, gated=gated, norm_weight=norm_w, eps=1e-5, residual=res, out=out)
        assert rel_err(out, gemv_ref(x, w, bias, gated, norm_w, 1e-5, res)) < TOL[dtype], (n, k)


def test_gemv_rows_do_not_depend_on_the_batch():
    """Each row's sum runs in one fixed order, so a row's output is the same alone or batched."""
    gen = torch.Generator().manual_seed(3)
    n, k = (4096, 14336) if ON_GPU else (24, 2100)  # K spans several tiles
    x = torch.randn(MAX_GEMV_ROWS, k, generator=gen).to(dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(n, k, generator=gen).to(dtype=torch.bfloat16, device=DEVICE)
    together = gemv(x, w)
    for i in range(MAX_GEMV_ROWS):
        assert torch.equal(gemv(x[i:i + 1], w)[0], together[i])


def test_gemv_rejects_bad_shapes():
    x, w = torch.randn(2, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="1..4 rows"):
        gemv(torch.randn(5, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match=r"x \[M, 2K\] and w \[N, K\]"):
        gemv(x, w, gated=True)
    with pytest.raises(ValueError, match="bias: expected"):
        gemv(x, w, torch.randn(3, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight: expected"):
        gemv(x, w, norm_weight=torch.randn(7, device=DEVICE))
    with pytest.raises(ValueError, match="residual: expected"):
        gemv(x, w, residual=torch.randn(2, 5, device=DEVICE))
