"""RMSNorm and fused residual-add + RMSNorm against the float64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernel_testlib import DEVICE, DTYPE_IDS, ON_GPU, TOL, poisoned, rel_err

from kernels import fused_add_rms_norm, rms_norm, rms_norm_fp8, rms_norm_ref
from kernels.fp8_quant import quantize_fp8_rows

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HIDDEN = (64, 80, 576, 4096, 5120) if ON_GPU else (64, 80, 576)
ROWS = (1, 7, 64) if ON_GPU else (1, 7)
GRID = list(itertools.product(HIDDEN, ROWS, (F32, F16, BF16)))


@pytest.mark.parametrize("hidden,rows,dtype", GRID, ids=[f"h{h}-t{t}-{DTYPE_IDS[d]}" for h, t, d in GRID])
def test_rms_norm(hidden, rows, dtype):
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    out = poisoned(x.shape, dtype)
    x_before = x.clone()
    rms_norm(x, w, 1e-6, out=out)
    ref, _ = rms_norm_ref(x, w, 1e-6)
    assert torch.equal(x, x_before)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("hidden,rows,dtype", GRID, ids=[f"h{h}-t{t}-{DTYPE_IDS[d]}" for h, t, d in GRID])
def test_fused_add_rms_norm_in_place(hidden, rows, dtype):
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    ref, ref_residual = rms_norm_ref(x, w, 1e-5, residual=residual)
    out = fused_add_rms_norm(x, residual, w, 1e-5)  # default: normalised into x
    assert out.data_ptr() == x.data_ptr()
    assert torch.equal(residual, ref_residual)  # the sum, rounded once to the residual dtype
    assert rel_err(out, ref) <= TOL[dtype]


def test_fused_add_rms_norm_separate_out_and_gemma_offset():
    x = torch.randn(5, 80, device=DEVICE).to(BF16)
    residual = torch.randn(5, 80, device=DEVICE).to(BF16)
    w = (0.1 * torch.randn(80, device=DEVICE)).to(BF16)
    x_before = x.clone()
    ref, ref_residual = rms_norm_ref(x, w, 1e-6, residual=residual, weight_offset=1.0)
    out = poisoned(x.shape, BF16)
    fused_add_rms_norm(x, residual, w, 1e-6, out=out, weight_offset=1.0)
    assert torch.equal(x, x_before) and torch.equal(residual, ref_residual)
    assert rel_err(out, ref) <= TOL[BF16]


def test_rms_norm_strided_rows():
    big = torch.randn(6, 200, device=DEVICE)
    x = big[:, :96]  # row stride 200
    w = torch.randn(96, device=DEVICE)
    out = rms_norm(x, w, 1e-6)
    assert rel_err(out, rms_norm_ref(x, w, 1e-6)[0]) <= TOL[F32]


def test_rms_norm_checks_arguments():
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(63, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(3, 32, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.t(), torch.ones(3, device=DEVICE), 1e-6)


def test_checks_format_their_message_only_when_failing():
    from kernels._common import require

    def unformattable() -> str:
        raise AssertionError("formatted although the check passed")

    require(True, unformattable)  # launch paths pass their messages as lambdas: nothing formatted on success
    with pytest.raises(ValueError, match=r"^x: shape \(3, 64\)$"):
        require(False, lambda: f"x: shape {(3, 64)}")
    with pytest.raises(ValueError, match=r"^out: shape \(3, 65\) != expected \(3, 64\)$"):
        rms_norm(torch.randn(3, 64, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6,
                 out=torch.empty(3, 65, device=DEVICE))


@pytest.mark.parametrize("hidden", [256, 300, 384, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["add", "plain"])
def test_rms_norm_fp8_is_the_norm_then_the_activation_quantizer(hidden, dtype, with_residual):
    """`rms_norm_fp8` (an fp8 projection's input in the norm's launch) gives the codes and scales of the 16-bit norm
    followed by `quantize_fp8_rows` (one scale a row) bit for bit, whole and odd widths, and the same residual."""
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype=dtype, device=DEVICE)
    residual = torch.randn(5, hidden, generator=gen).to(dtype=dtype, device=DEVICE) if with_residual else None
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype=dtype, device=DEVICE)
    fused_residual = residual.clone() if with_residual else None
    q, scale = rms_norm_fp8(x.clone(), fused_residual, weight, 1e-6)
    if with_residual:
        normed = fused_add_rms_norm(x.clone(), residual, weight, 1e-6)
        assert torch.equal(fused_residual, residual)
    else:
        normed = rms_norm(x, weight, 1e-6)
    q_ref, scale_ref = quantize_fp8_rows(normed, hidden)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    with pytest.raises(ValueError, match=r"x: expected \[num_tokens, hidden\]"):
        rms_norm_fp8(x[0], None, weight, 1e-6)
