"""Quantized checkpoints and in-situ quantization, model level: each tiny Llama loads packed (every
decoder projection a packed `QuantizedLinear`) and runs as its dequantized 16-bit twin does (same
weights expanded): logits within accumulation error (fp8: within the error of quantizing the
activations), the same greedy tokens. Prefill of 20 rows takes the GEMM, decode steps the GEMV.
On the CPU the kernels run in Triton's interpreter (conftest.py)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file

from inference_service.config import EngineConfig
from inference_service.model.config import ModelConfig
from inference_service.model.decoder import DecoderModel
from inference_service.model.linear import DenseLinear
from inference_service.model.loader import load_model
from inference_service.model.quant.config import QuantizationConfigError
from inference_service.model.quantized_linear import QuantizedLinear
from kernels.fp8_gemm import quantize_fp8_groups
from kernels.fp8_gemv import MAX_FP8_GEMV_ROWS
from tests.model.harness import PagedHarness
from tests.model.tiny_models import make_hf_model, save_hf_model
from tests.quant.checkpoints import TINY_LLAMA, write_quantized

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # 20 rows: the GEMM path
NUM_NEW_TOKENS = 4

# Logits tolerance relative to the largest logit: fp32 accumulation in another order.
TOLERANCE = 1e-4
# NOTE: with fp8 activations a last-bit difference in x can move an element across an e4m3 rounding
# boundary (steps of 1/16 relative), in the kernel but not in the twin; among the ~25k activations a
# prefill rounds, a few do, and each moves the logits by about a percent.
FP8_TOLERANCE = 0.1
# (format, label GetModelInfo reports, bits, fp8 activation block: None = weight-only)
CHECKPOINTS = [
    ("gptq", "gptq", 4, None),
    ("gptq-desc-act", "gptq", 4, None),
    ("gptq-channel", "gptq", 4, None),
    ("awq", "awq", 4, None),
    ("ct-w4a16", "compressed-tensors", 4, None),
    ("ct-fp8", "fp8", 8, 0),  # 0: the whole row (per-channel weight scales)
    ("fp8-block", "fp8", 8, 64),
]


class Fp8ActivationLinear(DenseLinear):
    """The twin of an fp8 projection: the dequantized weight, and x rounded to e4m3 as the fp8 GEMM
    rounds it (dynamic scales per row and `block_k` columns; 0 = the whole row) past MAX_FP8_GEMV_ROWS
    rows; up to them (decode) the fp8 GEMV takes x as it is. The lm_head (plain in the quantized model
    too) keeps `block_k` None: x as it is."""

    block_k: int | None = None

    def finish_loading(self) -> None:  # keep the plain weight (no oneDNN packing): forward reads it
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_k is not None and x.shape[0] > MAX_FP8_GEMV_ROWS:
            block = self.block_k or x.shape[1]
            q, scale = quantize_fp8_groups(x, block)  # [T, K] e4m3, [T, K / block]
            x = (q.float() * scale.repeat_interleave(block, 1)[:, : x.shape[1]]).to(x.dtype)
        return torch.nn.functional.linear(x, self.weight, self.bias)


def fp8_twin(folder: str, block_k: int) -> DecoderModel:
    with open(os.path.join(folder, "config.json")) as f:
        config = ModelConfig.from_hf_dict(json.load(f))
    twin = DecoderModel(config, device="cpu", dtype=torch.float32, linear_cls=Fp8ActivationLinear)
    twin.load_weights(load_file(os.path.join(folder, "model.safetensors")).items())
    for m in projections(twin):
        m.block_k = block_k
    return twin


def projections(model: DecoderModel) -> list:
    return [m for layer in model.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def run(model: DecoderModel) -> tuple[torch.Tensor, list[int]]:
    """(prefill logits [len(PROMPT), vocab], greedy tokens after the prompt)."""
    logits = PagedHarness(model).all_logits(PROMPT, 0, [])
    return logits, PagedHarness(model).generate([PROMPT], NUM_NEW_TOKENS)[0]


def assert_matches_twin(model: DecoderModel, twin: DecoderModel, tolerance: float = TOLERANCE) -> None:
    logits, tokens = run(model)
    twin_logits, twin_tokens = run(twin)
    error = float((logits - twin_logits).abs().max() / twin_logits.abs().max())
    assert error < tolerance, f"logits relative error {error:.2e} >= {tolerance}"
    assert tokens == twin_tokens


@pytest.mark.parametrize(("fmt", "label", "bits", "fp8_block"), CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_a_quantized_checkpoint_runs_as_its_dequantized_twin(fmt, label, bits, fp8_block, tmp_path):
    folder, twin_folder = write_quantized(fmt, str(tmp_path))
    loaded, twin = load_model(folder, device="cpu"), load_model(twin_folder, device="cpu")
    assert all(isinstance(m, QuantizedLinear) and m.is_packed for m in projections(loaded.model))
    assert isinstance(loaded.model.lm_head, QuantizedLinear) and not loaded.model.lm_head.is_packed  # kept 16-bit
    summary = loaded.quantization
    assert (summary.quantization, summary.bits) == (label, bits)
    assert summary.weight_bytes == loaded.model.num_weight_bytes < twin.quantization.weight_bytes
    assert (twin.quantization.quantization, twin.quantization.bits) == ("none", 16)
    if fp8_block is None:
        assert_matches_twin(loaded.model, twin.model)
    else:
        assert_matches_twin(loaded.model, fp8_twin(twin_folder, fp8_block), FP8_TOLERANCE)


def dequantized_twin(model: DecoderModel, fp8_block: int | None) -> DecoderModel:
    """A dense model with `model`'s weights, each packed projection expanded (the 16-bit twin)."""
    twin = DecoderModel(model.config, device="cpu", dtype=model.dtype, linear_cls=Fp8ActivationLinear)
    packed = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear) and m.is_packed}
    weights = [(name, p.detach()) for name, p in model.named_parameters()]
    weights += [(f"{name}.weight", m.dequantized_weight()) for name, m in packed.items()]
    twin.load_weights(weights)
    for m in projections(twin):
        m.block_k = fp8_block
    return twin


@pytest.mark.parametrize(("method", "bits", "fp8_block"), [("int4", 4, None), ("int8", 8, None), ("fp8", 8, 0),
                                                        ("q4_k", 4, None)])
def test_in_situ_quantization_runs_as_its_dequantized_twin(method, bits, fp8_block, tmp_path):
    folder = save_hf_model(make_hf_model("llama", seed=3, **TINY_LLAMA), str(tmp_path / "plain"))
    loaded = load_model(folder, device="cpu", quantization=method)
    plain = load_model(folder, device="cpu")
    assert all(isinstance(m, QuantizedLinear) and m.is_packed for m in projections(loaded.model))
    summary = loaded.quantization
    assert (summary.quantization, summary.bits) == (f"in-situ {method}", bits)
    assert summary.weight_bytes < plain.quantization.weight_bytes
    assert_matches_twin(loaded.model, dequantized_twin(loaded.model, fp8_block),
                        TOLERANCE if fp8_block is None else FP8_TOLERANCE)


def test_in_situ_quantization_of_a_tied_model_keeps_the_shared_lm_head(tmp_path):
    folder = save_hf_model(make_hf_model("llama", seed=4, tie_word_embeddings=True, **TINY_LLAMA),
                           str(tmp_path / "tied"))
    loaded = load_model(folder, device="cpu", quantization="int4")
    plain = load_model(folder, device="cpu")
    model = loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.is_packed
    assert all(m.is_packed for m in projections(model))
    assert loaded.quantization.unquantized_bytes == plain.quantization.unquantized_bytes
    assert loaded.quantization.weight_bytes == model.num_weight_bytes
    assert_matches_twin(model, dequantized_twin(model, None))


def test_in_situ_quantization_of_dummy_weights(tmp_path):
    folder = save_hf_model(make_hf_model("llama", seed=3, **TINY_LLAMA), str(tmp_path / "plain"))
    loaded = load_model(folder, device="cpu", load_format="dummy", quantization="int8")
    assert all(isinstance(m, QuantizedLinear) and m.is_packed for m in projections(loaded.model))
    assert (loaded.quantization.quantization, loaded.quantization.bits) == ("in-situ int8", 8)


def test_in_situ_quantization_is_validated_in_the_engine_config():
    with pytest.raises(ValueError, match=r"--quantization must be one of fp8, int8, int4, q4_k, got 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="--quantization and --dequantize contradict each other"):
        EngineConfig(quantization="int4", dequantize=True)
    assert EngineConfig(quantization="fp8").quantization == "fp8"


def test_in_situ_quantization_of_a_quantized_checkpoint_is_refused(tmp_path):
    folder, _ = write_quantized("gptq", str(tmp_path))
    with pytest.raises(ValueError, match=r"--quantization int4: the checkpoint is quantized already \(gptq\)"):
        load_model(folder, device="cpu", quantization="int4")


def _rewrite_config(folder: str, edit) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(path, "w") as f:
        json.dump(config, f)


MALFORMED = [
    ("gptq", lambda q: q.update(bits=3), "bits", "only 4-bit weights are supported, got 3"),
    ("gptq", lambda q: q.update(group_size=100), "group_size", "a positive multiple of 32 or -1, got 100"),
    ("gptq", lambda q: q.update(desc_act="yes"), "desc_act", "expected bool, got 'yes'"),
    ("awq", lambda q: q.update(version="gemv"), "version", "only the GEMM layout is supported, got 'gemv'"),
    ("ct-w4a16", lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"),
     "config_groups.group_0.weights.strategy", "expected group or channel, got 'tensor'"),
    ("fp8-block", lambda q: q.update(weight_block_size=[64]), "weight_block_size",
     "expected [rows, cols], multiples of 16, got [64]"),
    ("fp8-block", lambda q: q.pop("quant_method"), "quant_method", "missing"),
]


@pytest.mark.parametrize(("fmt", "edit", "field", "message"), MALFORMED, ids=[m[2] for m in MALFORMED])
def test_a_malformed_quantization_config_is_a_startup_error_naming_the_field(fmt, edit, field, message, tmp_path):
    folder, _ = write_quantized(fmt, str(tmp_path))
    _rewrite_config(folder, edit)
    with pytest.raises(QuantizationConfigError) as error:
        load_model(folder, device="cpu")
    assert error.value.field == field
    assert str(error.value) == f"quantization_config: {field}: {message}"


def test_a_quantized_tensor_of_the_wrong_shape_is_an_error_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = write_quantized("awq", str(tmp_path))
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.1.mlp.down_proj.scales"
    tensors[name] = tensors[name][:, :64].contiguous()
    save_file(tensors, path)
    with pytest.raises(QuantizationConfigError) as error:
        load_model(folder, device="cpu")
    assert str(error.value) == f"quantization_config: {name}: expected [4, 128], got (4, 64)"


def test_a_cpu_without_the_kernels_expands_the_packed_rows_at_load(tmp_path, monkeypatch, caplog):
    """On a CPU outside the Triton interpreter (a user's laptop) the quantized kernels cannot run: the
    packed rows are expanded into plain weights at load, the log says so, and the model answers as its
    dequantized twin."""
    folder, twin_folder = write_quantized("gptq", str(tmp_path))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with caplog.at_level(logging.WARNING, logger="inference_service.model.loader"):
        loaded = load_model(folder, device="cpu")
    assert not any(m.is_packed for m in projections(loaded.model))
    assert "gptq weights expanded to float32 at load" in caplog.text
    assert_matches_twin(loaded.model, load_model(twin_folder, device="cpu").model)
