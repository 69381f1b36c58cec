"""The tensor-core decode GEMV for 4-bit codes (`kernels.quant_gemv_tc`) against dequantize-then-matmul in
float64: constant and per-group zeros, per-channel scales, act-order, split K, the fused decoder's options."""

from __future__ import annotations

import pytest
import torch

import kernels.quant_gemm as quant_gemm_module
from kernels.norm import rms_norm
from kernels.quant_gemm import quant_matmul
from kernels.quant_gemv import quant_gemv
from kernels.quant_gemv_tc import quant_gemv_tc, takes_tensor_cores
from kernels.quant_layout import quant_matmul_ref
from kernels.quant_tiles import with_row_tiles
from kernels.split_k import _WORKSPACES
from tests.kernels.kernel_testlib import DEVICE, ON_GPU, TOL, poisoned, rel_err
from tests.kernels.test_kernel_quant_gemm import fused_case, random_packed

# name: (bits, group_size or None = per channel, per-group zeros, offsets, act-order permutation)
VARIANTS = {
    "gptq_g128_sym": (4, 128, False, False, False),
    "gptq_g128_actorder": (4, 128, True, False, True),
    "awq_g128": (4, 128, True, False, False),
    "int4_per_channel": (4, None, False, False, False),
    "q4_0_g32": (4, 32, False, False, False),  # GGUF Q4_0: four groups a K tile
    "awq_g64": (4, 64, True, False, False),  # two
}
SHAPES = [(4096, 4096), (1000, 14336)] if ON_GPU else [(72, 512), (40, 384)]
# the output's rounding alone: half an ulp of bf16 / fp16, relative, with room for fp32 summation order
OUT_TOL = {torch.bfloat16: 3e-3, torch.float16: 5e-4}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_rows,split_k", [(1, 1), (1, 2), (5, 4), (16, 1)])
def test_matches_dequantized_reference(variant, dtype, num_rows, split_k):
    """Exact products, fp32 sums: the error is the output's rounding (a wrong group, nibble or zero is ~1)."""
    gen = torch.Generator().manual_seed(num_rows * 7 + split_k + len(variant))
    for n, k in SHAPES:
        w = random_packed(n, k, *VARIANTS[variant], gen)
        x = torch.randn(num_rows, k, generator=gen).to(dtype=dtype, device=DEVICE)
        assert takes_tensor_cores(w, x)
        bias = torch.randn(n, generator=gen).to(dtype=dtype, device=DEVICE) if num_rows == 5 else None
        out = poisoned((num_rows, n), dtype)
        quant_gemv_tc(x, w, bias, out=out, split_k=split_k)
        assert rel_err(out, quant_matmul_ref(x, w, bias)) < OUT_TOL[dtype], (variant, n, k)


@pytest.mark.parametrize("variant", ["gated_residual", "norm", "bias_norm_residual"])
@pytest.mark.parametrize("num_rows,split_k", [(1, 1), (1, 4), (16, 2)])
@pytest.mark.parametrize("groups", [128, 32])
def test_fused_decoder_options(variant, num_rows, split_k, groups):
    """down (gated, residual), qkv / gate_up (norm, bias), o (residual); the norm's sums cover all of K when
    K is split; groups of 32 step through four sub-tiles a K tile."""
    gen = torch.Generator().manual_seed(num_rows + 3 * len(variant) + split_k)
    weight = "q4_0_g32" if groups == 32 else "gptq_g128_actorder" if "norm" in variant else "gptq_g128_sym"
    for n, k in SHAPES:
        w = random_packed(n, k, *VARIANTS[weight], gen)
        x, bias, norm_w, res, gated = fused_case(variant, num_rows, n, k, gen)
        out = poisoned((num_rows, n), torch.bfloat16)
        quant_gemv_tc(x, w, bias, gated=gated, norm_weight=norm_w, eps=1e-5, residual=res, out=out, split_k=split_k)
        ref = quant_matmul_ref(x, w, bias, gated, norm_w, 1e-5, res)
        assert rel_err(out, ref) < TOL[torch.bfloat16], (variant, n, k)


def test_split_k_leaves_its_counters_zeroed_and_repeats_exactly_over_a_dirty_workspace():
    """The last program of each column tile sums the partials in a fixed order and resets its counter: a
    second call (another shape) starts clean, and the same call gives the same bits whatever the workspace
    holds (each split writes its partials before it arrives; NaN left there would show)."""
    gen = torch.Generator().manual_seed(4)
    w = random_packed(72, 512, *VARIANTS["awq_g128"], gen)
    x = torch.randn(3, 512, generator=gen).to(torch.bfloat16).to(DEVICE)
    first = quant_gemv_tc(x, w, split_k=4)
    ws, counts = _WORKSPACES[x.device]
    assert not counts.any()
    other = random_packed(40, 384, *VARIANTS["gptq_g128_sym"], gen)
    quant_gemv_tc(x[:, :384], other, split_k=2)
    ws.fill_(float("nan"))
    assert torch.equal(quant_gemv_tc(x, w, split_k=4), first)
    assert not counts.any()
    assert rel_err(first, quant_matmul_ref(x, w)) < OUT_TOL[torch.bfloat16]


def test_takes_only_what_it_computes_exactly():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert takes_tensor_cores(random_packed(8, 256, 4, 128, False, False, False, gen), x)
    assert not takes_tensor_cores(random_packed(8, 256, 4, 128, False, False, False, gen), x.float())
    assert takes_tensor_cores(random_packed(8, 256, 4, 32, False, False, False, gen), x)  # Q4_0
    assert not takes_tensor_cores(random_packed(8, 256, 4, 16, False, False, False, gen), x)  # groups of 16
    assert not takes_tensor_cores(random_packed(8, 256, 4, 32, False, True, False, gen), x)  # offsets (Q4_K)
    assert not takes_tensor_cores(random_packed(8, 256, 8, 128, False, False, False, gen), x)  # 8-bit codes


@pytest.mark.parametrize("num_rows", [1, 2, 8])
def test_quant_matmul_routes_4bit_codes_through_it(num_rows, monkeypatch):
    """The entry point: one gated row (its gate in a launch of its own), 2 fused rows and 8 plain rows all end
    on the tensor-core kernel and match the reference."""
    monkeypatch.setattr("kernels.quant_gemv.ONE_ROW", "split")
    gen = torch.Generator().manual_seed(8 + num_rows)
    n, k = SHAPES[0]
    w = random_packed(n, k, *VARIANTS["gptq_g128_sym"], gen)
    x = torch.randn(num_rows, 2 * k, generator=gen).to(torch.bfloat16).to(DEVICE)
    res = torch.randn(num_rows, n, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = quant_matmul(x, w, gated=True, residual=res)
    assert rel_err(out, quant_matmul_ref(x, w, gated=True, residual=res)) < TOL[torch.bfloat16]
    plain = quant_matmul(x[:, :k], w)
    assert torch.equal(plain, quant_gemv_tc(x[:, :k], w))
    assert rel_err(plain, quant_matmul_ref(x[:, :k], w)) < OUT_TOL[torch.bfloat16]


@pytest.mark.parametrize("one_row", ["split", "fused", "cuda"])
def test_one_normed_row_takes_the_route_asked_for(one_row, monkeypatch):
    """One row with the RMSNorm prologue (qkv, gate_up at batch 1): "split" normalizes in a launch of its own
    (`rms_norm`) and runs the plain tensor-core GEMV, "fused" the tensor-core GEMV's prologue, "cuda" the
    CUDA-core GEMV's; each is the reference up to rounding."""
    monkeypatch.setattr("kernels.quant_gemv.ONE_ROW", one_row)
    gen = torch.Generator().manual_seed(11)
    n, k = SHAPES[0]
    w = with_row_tiles(random_packed(128, k, *VARIANTS["gptq_g128_actorder"], gen))
    x, bias, norm_w, res, _ = fused_case("bias_norm_residual", 1, 128, k, gen)
    out = quant_matmul(x, w, bias, norm_weight=norm_w, eps=1e-5, residual=res)
    assert rel_err(out, quant_matmul_ref(x, w, bias, False, norm_w, 1e-5, res)) < TOL[torch.bfloat16]
    expected = {"split": lambda: quant_gemv_tc(rms_norm(x, norm_w, 1e-5), w, bias, residual=res),
                "fused": lambda: quant_gemv_tc(x, w, bias, norm_weight=norm_w, eps=1e-5, residual=res),
                "cuda": lambda: quant_gemv(x, w, bias, norm_weight=norm_w, eps=1e-5, residual=res, block_k=1024)}
    assert torch.equal(out, expected[one_row]())


@pytest.mark.parametrize("num_rows", [1, 2])
def test_groups_of_32_take_the_tensor_cores_from_two_rows(num_rows, monkeypatch):
    """GGUF Q4_0-like weights (groups of 32): one row stays on the CUDA cores (as cheap there), two fused rows go
    to the tensor cores."""
    monkeypatch.setattr("kernels.quant_gemv.ONE_ROW", "split")
    gen = torch.Generator().manual_seed(12)
    n, k = SHAPES[0]
    w = random_packed(n, k, *VARIANTS["q4_0_g32"], gen)
    x, bias, norm_w, res, _ = fused_case("norm_residual", num_rows, n, k, gen)
    out = quant_matmul(x, w, bias, norm_weight=norm_w, eps=1e-5, residual=res)
    on_cuda_cores = quant_gemv(x, w, bias, norm_weight=norm_w, eps=1e-5, residual=res, block_k=1024)
    on_tensor_cores = quant_gemv_tc(x, w, bias, norm_weight=norm_w, eps=1e-5, residual=res)
    assert torch.equal(out, on_cuda_cores if num_rows == 1 else on_tensor_cores)
    assert rel_err(out, quant_matmul_ref(x, w, bias, False, norm_w, 1e-5, res)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("variant", ["gptq_g128_actorder", "awq_g128", "q4_0_g32"])
@pytest.mark.parametrize("num_rows,block_m,split_k", [(17, 16, 1), (40, 32, 2), (70, 64, 4), (130, 128, 1),
                                                    (70, 128, 2)])
def test_row_blocks_past_sixteen_rows(variant, num_rows, block_m, split_k):
    """Past 16 rows x comes in row blocks (the last one partial), each block's split-K partials in its own
    slab and counter; blocks past 64 rows scale the weight before the MMA, rounded to bf16 as the GEMM rounds
    it."""
    gen = torch.Generator().manual_seed(num_rows + block_m + split_k)
    n, k = SHAPES[0]
    w = random_packed(n, k, *VARIANTS[variant], gen)
    x = torch.randn(num_rows, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = poisoned((num_rows, n), torch.bfloat16)
    quant_gemv_tc(x, w, bias, out=out, block_m=block_m, split_k=split_k)
    assert rel_err(out, quant_matmul_ref(x, w, bias)) < (OUT_TOL if block_m <= 64 else TOL)[torch.bfloat16], variant
    _, counts = _WORKSPACES.get(x.device, (torch.zeros(1), torch.zeros(1)))
    assert not counts.any()


@pytest.mark.parametrize("n,k,variant,num_rows,takes_row_blocks", [
    (64, 256, "gptq_g128_sym", 64, True), (64, 256, "gptq_g128_sym", 65, False), (16, 8192, "gptq_g128_sym", 129, True),
    (16384, 128, "gptq_g128_sym", 65, True), (16, 8192, "awq_g128", 128, True), (16, 8192, "awq_g128", 129, False),
    (64, 256, "q4_0_g32", 20, False)])
def test_quant_matmul_sends_wide_and_long_weights_to_row_blocks(n, k, variant, num_rows, takes_row_blocks,
                                                                 monkeypatch):
    """Past 16 rows (below the widening's 512) every weight in groups of 128 or more takes the row blocks up to
    64 rows, past that the wide and the long ones (with a zeros plane up to 128 rows); the others the GEMM."""
    gen = torch.Generator().manual_seed(n + k)
    w = random_packed(n, k, *VARIANTS[variant], gen)
    x = torch.randn(num_rows, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    called = []
    for name in ("quant_gemv_tc", "quant_gemm"):
        real = getattr(quant_gemm_module, name)
        monkeypatch.setattr(quant_gemm_module, name, lambda *a, real=real, name=name, **kw: called.append(name)
                            or real(*a, **kw))
    out = quant_matmul(x, w)
    assert called == ["quant_gemv_tc" if takes_row_blocks else "quant_gemm"]
    assert rel_err(out, quant_matmul_ref(x, w)) < TOL[torch.bfloat16]
