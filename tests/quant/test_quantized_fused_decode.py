"""Quantized projections on the fused stack's folded decode path (`model/fused_stack.py`): int-packed
weights run `kernels.quant_matmul` with the RMSNorm in the qkv and gate_up prologues, the SiLU gate in
down's and the residual adds in o's and down's epilogues, and give what the same model's general path
gives (separate norm, gate and add launches) within fp32 rounding. Under the Triton interpreter, with the
fold opened to fp32 (on the GPU it takes bf16/fp16 only)."""

from __future__ import annotations

import pytest
import torch

import kernels
from inference_service.model import fused_stack
from inference_service.model.decoder import DecoderModel
from inference_service.model.loader import load_model
from inference_service.model.quantized_linear import QuantizedLinear
from kernels._common import is_interpreter
from tests.model.harness import PagedHarness
from tests.model.tiny_models import make_hf_model, save_hf_model
from tests.quant.checkpoints import TINY_LLAMA

# NOTE: the models here live on the CPU, which only the interpreter runs Triton kernels on; a GPU machine's
# compiled run meets the fold in tests/kernels/test_kernel_fused_decoder.py instead
pytestmark = pytest.mark.skipif(not is_interpreter(), reason="CPU models through Triton's interpreter")

PROMPTS = [[5, 17, 99, 3, 42, 7], [250, 11, 1, 2]]
NUM_STEPS = 2  # the fold is planned at the first step: two steps show it kept


@pytest.fixture
def fused_fp32(monkeypatch):
    """Decoders built in the test run the fused stack, whose fold also takes fp32 batches."""
    monkeypatch.setattr(fused_stack, "uses_gemv", lambda x, dtype: x.shape[0] <= kernels.MAX_GEMV_ROWS)
    init = DecoderModel.__init__
    monkeypatch.setattr(DecoderModel, "__init__",
                        lambda self, config, **kw: init(self, config, **{**kw, "fused_kernels": True}))


def _decode_logits(model: DecoderModel, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each greedy decode step's logits [S, vocab], the prompts prefilled together first."""
    harness = PagedHarness(model)
    tables: list[list[int]] = [[] for _ in prompts]
    logits = harness.step(prompts, [0] * len(prompts), tables)
    cached = [len(p) for p in prompts]
    steps = []
    for _ in range(NUM_STEPS):
        logits = harness.step([[int(row.argmax())] for row in logits], cached, tables)
        cached = [c + 1 for c in cached]
        steps.append(logits)
    return steps


@pytest.mark.parametrize(("method", "num_seqs", "max_rows"), [("int4", 2, 2), ("int8", 1, 4), ("int8", 4, 4)])
def test_int_packed_projections_fold_into_the_decode_path(method, num_seqs, max_rows, fused_fp32, tmp_path,
                                                          monkeypatch):
    """Decode batches up to `gemv_faster_rows` rows (4 for 8-bit codes) run every projection through the GEMV with
    the norms, SiLU and residual folded in, with the general path's logits."""
    folder = save_hf_model(make_hf_model("llama", seed=3, **TINY_LLAMA), str(tmp_path / "plain"))
    model = load_model(folder, device="cpu", quantization=method).model
    stack = model.stack
    assert type(stack) is fused_stack.FusedStack
    stack.plan_folding()
    assert stack.can_fold_gemv and stack.max_fold_rows == max_rows
    assert all(isinstance(m, QuantizedLinear) and m.is_packed for layer in model.model.layers
               for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
    calls = []
    quant_matmul = kernels.quant_matmul
    monkeypatch.setattr(kernels, "quant_matmul", lambda *a, **kw: calls.append(sorted(kw)) or quant_matmul(*a, **kw))
    prompts = (PROMPTS * 2)[:num_seqs]
    folded = _decode_logits(model, prompts)
    # Every layer's four projections, with their fused options, at every decode step
    per_step = [["eps", "norm_weight"], ["gated", "residual"], ["eps", "norm_weight"], ["gated", "residual"]]
    assert calls == per_step * model.config.num_hidden_layers * NUM_STEPS
    monkeypatch.setattr(stack, "can_fold_gemv", False)
    general = _decode_logits(model, prompts)
    for step, (a, b) in enumerate(zip(folded, general)):
        error = float((a - b).abs().max() / b.abs().max())
        assert error < 1e-5, f"decode step {step}: relative error {error:.1e}"
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_three_sequences_take_the_general_path(fused_fp32, tmp_path, monkeypatch):
    """Past QUANT_GEMV_FASTER_ROWS rows the tensor-core GEMM wins: no fold, no fused options."""
    folder = save_hf_model(make_hf_model("llama", seed=3, **TINY_LLAMA), str(tmp_path / "plain"))
    model = load_model(folder, device="cpu", quantization="int4").model
    calls = []
    quant_matmul = kernels.quant_matmul
    monkeypatch.setattr(kernels, "quant_matmul", lambda *a, **kw: calls.append(kw) or quant_matmul(*a, **kw))
    _decode_logits(model, PROMPTS + [[9, 8, 7]])
    assert not any(calls)


def test_fp8_projections_take_their_input_quantized_where_it_is_computed(fused_fp32, tmp_path, monkeypatch):
    """An fp8 model's qkv and gate_up projections take their input quantized in the RMSNorm's launch
    (`kernels.fp8_normed_linear`) and its down projections in the SiLU's (`kernels.fp8_gated_linear`), at prefill
    and decode, and give exactly the logits of the separate norm, SiLU and quantizer launches."""
    folder = save_hf_model(make_hf_model("llama", seed=3, **TINY_LLAMA), str(tmp_path / "plain"))
    model = load_model(folder, device="cpu", quantization="fp8").model
    assert type(model.stack) is fused_stack.FusedStack
    rows = {"normed": [], "gated": []}
    normed, gated = kernels.fp8_normed_linear, kernels.fp8_gated_linear
    monkeypatch.setattr(kernels, "fp8_normed_linear",
                        lambda x, r, nw, eps, w, b=None: rows["normed"].append(x.shape[0]) or normed(x, r, nw, eps, w, b))
    monkeypatch.setattr(kernels, "fp8_gated_linear", lambda x, w, b=None: rows["gated"].append(x.shape[0]) or gated(x, w, b))
    fused = _decode_logits(model, PROMPTS)
    num_layers, prefill_rows = model.config.num_hidden_layers, sum(map(len, PROMPTS))
    steps = [prefill_rows] + [len(PROMPTS)] * NUM_STEPS
    assert rows == {"normed": [r for r in steps for _ in range(2 * num_layers)],
                    "gated": [r for r in steps for _ in range(num_layers)]}

    def unfused_normed(x, residual, norm_weight, eps, w, bias=None):
        y = kernels.rms_norm(x, norm_weight, eps) if residual is None else kernels.fused_add_rms_norm(
            x, residual, norm_weight, eps)
        return kernels.fp8_linear(y, w, bias)

    monkeypatch.setattr(kernels, "fp8_normed_linear", unfused_normed)
    monkeypatch.setattr(kernels, "fp8_gated_linear",
                        lambda x, w, b=None: kernels.fp8_linear(kernels.silu_and_mul(x), w, b))
    unfused = _decode_logits(model, PROMPTS)
    for step, (a, b) in enumerate(zip(fused, unfused)):
        assert torch.equal(a, b), f"decode step {step}"
