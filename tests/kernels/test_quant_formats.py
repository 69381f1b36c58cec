"""Checkpoint formats parsed into the packed layouts: GGUF bit-exact against the `gguf` package; GPTQ and
AWQ against their documented packers (written out below as AutoGPTQ / AutoAWQ write them);
compressed-tensors against the `compressed-tensors` package; fp8 checkpoints; in-situ quantization;
malformed configs and tensors named in the error. Each packed weight also goes through the kernel."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import (
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

from inference_service.model.quant import (
    QuantizationConfigError,
    QuantMethod,
    concat_rows,
    dequantize_packed,
    describe_weight,
    group_layer_tensors,
    is_in_situ_target,
    pack_checkpoint_linear,
    packed_linear,
    parse_quantization_config,
    quantize_in_situ,
    repack_gguf,
    repack_reader_tensor,
    select_rows,
    summarize,
)
from inference_service.model.quant.checkpoint import AWQ_ORDER
from inference_service.model.quant.in_situ import q4_k_parts
from kernels import FP8_DTYPE
from kernels.fp8_gemm import Fp8Weight, dequantize_fp8, fp8_linear, fp8_matmul_ref
from kernels.quant_gemm import quant_matmul
from kernels.quant_layout import IntPackedWeight, dequantize_int, quant_matmul_ref
from tests.kernels.kernel_testlib import DEVICE, TOL, rel_err

# type: (block bytes, elements a block, byte offsets of the fp16 scale/min fields)
GGUF_TYPES = {"Q4_0": (18, 32, [0]), "Q4_1": (20, 32, [0, 2]), "Q8_0": (34, 32, [0]),
              "Q4_K": (144, 256, [0, 2]), "Q5_K": (176, 256, [0, 2]), "Q6_K": (210, 256, [208])}


def random_gguf_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random quants and sub-scales with finite random fp16 scales: [rows, row bytes] uint8."""
    block_bytes, per_block, fp16_fields = GGUF_TYPES[type_name]
    blocks = rng.integers(0, 256, (rows * cols // per_block, block_bytes), dtype=np.uint8)
    for at in fp16_fields:
        blocks[:, at:at + 2] = (rng.standard_normal((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_repack_dequantizes_bit_exact_and_multiplies(type_name):
    rng = np.random.default_rng(7)
    rows, cols = 12, 512
    raw = random_gguf_blocks(type_name, rows, cols, rng)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])  # [rows, cols] float32
    w = repack_gguf(raw, type_name)
    assert w.shape == (rows, cols)
    assert w.bits == {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4}.get(type_name, 8)  # Q5_K / Q6_K codes one a byte
    assert np.array_equal(dequantize_int(w).numpy().view(np.uint32), expected.view(np.uint32))
    order = rng.permutation(rows)
    assert np.array_equal(dequantize_int(select_rows(w, order)).numpy(), expected[order])
    x = torch.randn(3, cols, dtype=torch.bfloat16, device=DEVICE)
    ref = x.double() @ torch.from_numpy(expected).double().T.to(DEVICE)
    assert rel_err(quant_matmul(x, w.to(DEVICE)), ref) < TOL[torch.bfloat16]


def test_gguf_file_tensor_repacks(tmp_path):
    """Through a real GGUF file: the reader's tensor (dims fastest-first) repacks to the matrix gguf reads."""
    rng = np.random.default_rng(2)
    raw = random_gguf_blocks("Q6_K", 6, 512, rng)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors[0]
    expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(6, 512)
    assert np.array_equal(dequantize_int(repack_reader_tensor(tensor)).numpy(), expected)


def test_gguf_unpacked_type_is_refused():
    with pytest.raises(ValueError, match="GGUF type Q2_K is not kept packed"):
        repack_gguf(np.zeros((1, 84), np.uint8), "Q2_K")


# ---- GPTQ / AWQ: the packers as AutoGPTQ and AutoAWQ write them ------------------------------------

def gptq_pack_ref(codes_kn: np.ndarray, zeros_gn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ QuantLinear.pack: 8 input rows a word (row 8r + i at bits 4i); zeros stored minus one,
    8 columns a word."""
    k, n = codes_kn.shape
    qweight = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(8):
        qweight |= codes_kn[i::8].astype(np.uint32) << (4 * i)
    stored = (zeros_gn - 1).astype(np.uint32)
    qzeros = np.zeros((zeros_gn.shape[0], n // 8), dtype=np.uint32)
    for i in range(8):
        qzeros |= stored[:, i::8] << (4 * i)
    return qweight.view(np.int32), qzeros.view(np.int32)


def awq_pack_ref(values_rn: np.ndarray) -> np.ndarray:
    """AutoAWQ WQLinear_GEMM: 8 columns a word, column order_map[i] at bits 4i."""
    packed = np.zeros((values_rn.shape[0], values_rn.shape[1] // 8), dtype=np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        packed |= values_rn[:, col::8].astype(np.uint32) << (4 * i)
    return packed.view(np.int32)


@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_checkpoint(group_size, desc_act):
    rng = np.random.default_rng(abs(group_size) + desc_act)
    k, n = 256, 48
    group = k if group_size == -1 else group_size
    codes = rng.integers(0, 16, (k, n))
    zeros = rng.integers(1, 16, (k // group, n))
    scales = torch.from_numpy(rng.random((k // group, n)) * 0.01 + 1e-3).half()
    g_idx = np.arange(k) // group
    if desc_act:  # act-order: input rows quantized in a permuted order, groups follow it
        g_idx = g_idx[np.argsort(rng.permutation(k))]
    qweight, qzeros = gptq_pack_ref(codes, zeros)
    spec = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                      "desc_act": desc_act, "sym": True})
    w = pack_checkpoint_linear(spec, "layer", {"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros),
                                               "scales": scales, "g_idx": torch.from_numpy(g_idx.astype(np.int32))})
    assert (w.perm is not None) == (desc_act and group_size != -1)  # one group: act-order changes nothing
    # w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
    expected = (scales.double()[g_idx] * torch.from_numpy(codes - zeros[g_idx]).double()).T
    assert torch.equal(dequantize_int(w, torch.float64), expected)
    x = torch.randn(5, k, dtype=torch.float16, device=DEVICE)
    assert rel_err(quant_matmul(x, w.to(DEVICE)), x.double() @ expected.T.to(DEVICE)) < TOL[torch.float16]


def test_gptq_symmetric_zeros_become_a_constant():
    k, n = 128, 16
    codes = np.random.default_rng(1).integers(0, 16, (k, n))
    qweight, qzeros = gptq_pack_ref(codes, np.full((1, n), 8))
    spec = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128})
    w = pack_checkpoint_linear(spec, "l", {"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros),
                                           "scales": torch.ones(1, n, dtype=torch.float16)})
    assert w.zeros is None and w.zero == 8


def test_awq_checkpoint():
    rng = np.random.default_rng(3)
    k, n, group = 256, 32, 128
    codes, zeros = rng.integers(0, 16, (k, n)), rng.integers(0, 16, (k // group, n))
    scales = torch.from_numpy(rng.random((k // group, n)) * 0.01 + 1e-3).half()
    spec = parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                      "version": "gemm"})
    w = pack_checkpoint_linear(spec, "l", {"qweight": torch.from_numpy(awq_pack_ref(codes)),
                                           "qzeros": torch.from_numpy(awq_pack_ref(zeros)), "scales": scales})
    rows = np.arange(k) // group
    expected = (scales.double()[rows] * torch.from_numpy(codes - zeros[rows]).double()).T
    assert torch.equal(dequantize_int(w, torch.float64), expected)
    x = torch.randn(20, k, dtype=torch.bfloat16, device=DEVICE)  # the GEMM path
    assert rel_err(quant_matmul(x, w.to(DEVICE)), quant_matmul_ref(x, w.to(DEVICE))) < TOL[torch.bfloat16]


# ---- compressed-tensors ------------------------------------------------------------------------

def ct_config(preset: str, fmt: str) -> dict:
    cfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, format=fmt,
                             ignore=["lm_head"])
    return cfg.model_dump(exclude_none=True)


@pytest.mark.parametrize("preset,bits", [("W4A16", 4), ("W8A16", 8)])
def test_compressed_tensors_pack_quantized(preset, bits):
    spec = parse_quantization_config(ct_config(preset, "pack-quantized"))
    assert (spec.method, spec.bits, spec.group_size) == (QuantMethod.PACKED_INT, bits, 128)
    assert spec.is_ignored("lm_head") and not spec.is_ignored("model.layers.0.mlp.down_proj")
    n, k = 24, 256
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, k // 128, generator=gen).to(torch.bfloat16)
    packed = pack_to_int32(q, bits)
    assert torch.equal(unpack_from_int32(packed, bits, torch.Size((n, k))), q)  # the package's own round trip
    w = pack_checkpoint_linear(spec, "l", {"weight_packed": packed, "weight_scale": scale,
                                           "weight_shape": torch.tensor([n, k])})
    expected = scale.double().repeat_interleave(128, 1) * q.double()
    assert torch.equal(dequantize_int(w, torch.float64), expected)
    x = torch.randn(2, k, dtype=torch.bfloat16, device=DEVICE)
    assert rel_err(quant_matmul(x, w.to(DEVICE)), x.double() @ expected.T.to(DEVICE)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8_BLOCK"])
def test_compressed_tensors_float_quantized(preset):
    spec = parse_quantization_config(ct_config(preset, "float-quantized"))
    n, k = 256, 384
    weight = (torch.randn(n, k) * 50).to(FP8_DTYPE)
    scale = torch.rand(n, 1) + 0.5 if preset == "FP8_DYNAMIC" else torch.rand(2, 3) + 0.5
    w = pack_checkpoint_linear(spec, "l", {"weight": weight, "weight_scale": scale})
    block = (1, k) if preset == "FP8_DYNAMIC" else (128, 128)
    assert (w.block_n, w.block_k) == block
    expected = weight.double() * scale.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert torch.equal(dequantize_fp8(w), expected)


def test_fp8_block_checkpoint_with_weight_scale_inv():
    """Qwen3-*-FP8 / DeepSeek-V3: quant_method fp8, weight_block_size, ragged last blocks."""
    spec = parse_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]})
    n, k = 200, 320  # 2 x 3 blocks, the last ones partial
    weight = (torch.randn(n, k) * 50).to(FP8_DTYPE)
    scale_inv = torch.rand(2, 3) * 1e-3
    w = pack_checkpoint_linear(spec, "model.layers.0.mlp.up_proj", {"weight": weight, "weight_scale_inv": scale_inv})
    x = torch.randn(3, k, dtype=torch.bfloat16, device=DEVICE)
    assert rel_err(fp8_linear(x, w.to(DEVICE)), fp8_matmul_ref(x, w.to(DEVICE))) < TOL[torch.bfloat16]
    assert describe_weight(w)["format"] == "fp8 e4m3 (block 128x128)"
    with pytest.raises(QuantizationConfigError, match=r"model.layers.0.mlp.up_proj.weight_scale_inv: expected \[2, 3\]"):
        pack_checkpoint_linear(spec, "model.layers.0.mlp.up_proj", {"weight": weight, "weight_scale_inv": torch.ones(2, 2)})


# ---- in-situ quantization ----------------------------------------------------------------------

@pytest.mark.parametrize("method,bound", [("int4", 0.12), ("int8", 0.01), ("fp8", 0.05), ("q4_k", 0.1)])
def test_in_situ_quantization(method, bound):
    gen = torch.Generator().manual_seed(11)
    w16 = (torch.randn(64, 256, generator=gen) * 0.02).to(torch.bfloat16)
    w = quantize_in_situ(w16, method)
    deq = dequantize_fp8(w) if isinstance(w, Fp8Weight) else dequantize_int(w, torch.float64)
    assert rel_err(deq, w16.double()) < bound
    assert w.nbytes < w16.nbytes * {"int4": 0.3, "q4_k": 0.4}.get(method, 0.55)  # q4_k: 6 bits a weight
    if method in ("int4", "int8"):  # the largest magnitude of each group lands on the last code
        qmax = 7 if method == "int4" else 127
        assert w.group_size == (128 if method == "int4" else 256)
        group_amax = deq.abs().view(64, -1, w.group_size).amax(-1)
        assert torch.equal(group_amax, w.scales.double() * qmax)


def test_in_situ_int4_codes_exact():
    w16 = torch.tensor([[0.7, -0.7, 0.3, 0.0] * 32], dtype=torch.float32)  # amax 0.7: scale 0.1 (fp16)
    w = quantize_in_situ(w16, "int4")
    assert w.zero == 8 and w.zeros is None
    assert torch.equal(dequantize_int(w, torch.float64)[0, :4], torch.tensor([7, -7, 3, 0], dtype=torch.float64)
                       * float(w.scales[0, 0]))


def test_in_situ_q4_k_is_gguf_q4_k():
    """In-situ q4_k gives GGUF's Q4_K numbers: its fields written as Q4_K blocks and read back by the `gguf`
    package give the weight bit for bit (and the loader's repack of those blocks the same packed weight); rows
    whose K is off the 256-column super-block take Q4_1."""
    gen = torch.Generator().manual_seed(4)
    w32 = torch.randn(3, 512, generator=gen) * 0.02 + torch.linspace(0, 0.05, 512)  # groups off zero
    w = quantize_in_situ(w32, "q4_k")
    assert (w.bits, w.group_size, w.zero) == (4, 32, 0) and w.offsets is not None
    assert rel_err(dequantize_int(w, torch.float64), w32.double()) < 0.06
    blocks = _q4_k_blocks(*q4_k_parts(w32))  # [3, 2 * 144] bytes as llama.cpp lays them out
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(3, 512)
    assert np.array_equal(dequantize_int(w).numpy(), expected)
    repacked = repack_gguf(blocks, "Q4_K")
    assert all(torch.equal(getattr(repacked, f), getattr(w, f)) for f in ("qs", "scales", "offsets"))
    q4_1 = quantize_in_situ(w32[:, :160], "q4_k")  # K off the super-block: GGUF's Q4_1, fp16 scale and min
    assert q4_1.scales.dtype == q4_1.offsets.dtype == torch.float16
    assert rel_err(dequantize_int(q4_1, torch.float64), w32[:, :160].double()) < 0.08
    with pytest.raises(ValueError, match="q4_k: K=100 is not a multiple of 32"):
        quantize_in_situ(torch.randn(4, 100), "q4_k")


def _q4_k_blocks(codes, d, sc, dmin, m) -> np.ndarray:
    """Q4_K fields as GGUF blocks: d, dmin, the 12 bytes of 6-bit scales and mins (get_scale_min's packing),
    128 bytes of codes (a 64-column chunk's low nibbles are its first 32 columns)."""
    n = codes.shape[0]
    sc, m = (t.numpy().astype(np.uint8).reshape(-1, 8) for t in (sc, m))
    packed = np.zeros((len(sc), 12), np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((m[:, 4:8] & 15) << 4)
    quads = codes.numpy().astype(np.uint8).reshape(-1, 4, 2, 32)  # [blocks, chunk, half, column]
    qs = (quads[:, :, 0] | (quads[:, :, 1] << 4)).reshape(-1, 128)
    d, dmin = (t.numpy().reshape(-1, 1).view(np.uint8) for t in (d, dmin))
    return np.concatenate([d, dmin, packed, qs], axis=1).reshape(n, -1)


# ---- malformed configs and tensors -------------------------------------------------------------

@pytest.mark.parametrize("cfg,field", [
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ({"bits": 4}, "quant_method"),
    ({"quant_method": "gptq", "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": "yes"}, "desc_act"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, "sym"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {"weights": {
        "type": "int", "num_bits": 8, "strategy": "channel"}}}}, "format"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "type": "int", "num_bits": 4, "strategy": "tensor"}}}}, "config_groups.g.weights.strategy"),
])
def test_malformed_config_names_the_field(cfg, field):
    with pytest.raises(QuantizationConfigError) as info:
        parse_quantization_config(cfg)
    assert info.value.field == field
    assert str(info.value).startswith(f"quantization_config: {field}: ")


def test_config_type_errors_read_plainly():
    with pytest.raises(QuantizationConfigError, match=r"^quantization_config: desc_act: expected bool, got 'yes'$"):
        parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": "yes"})
    with pytest.raises(QuantizationConfigError, match=r"^quantization_config: bits: expected int, got True$"):
        parse_quantization_config({"quant_method": "gptq", "bits": True, "group_size": 128})


def test_malformed_tensors_name_the_tensor():
    spec = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128})
    qweight, qzeros = gptq_pack_ref(np.zeros((256, 16), np.int64), np.ones((2, 16), np.int64))
    tensors = {"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros),
               "scales": torch.ones(2, 16, dtype=torch.float16)}
    with pytest.raises(QuantizationConfigError, match="model.layers.3.self_attn.o_proj.scales: missing"):
        pack_checkpoint_linear(spec, "model.layers.3.self_attn.o_proj",
                               {k: v for k, v in tensors.items() if k != "scales"})
    with pytest.raises(QuantizationConfigError, match=r"o_proj.scales: expected \[2, 16\]"):
        pack_checkpoint_linear(spec, "o_proj", {**tensors, "scales": torch.ones(1, 16)})
    bad_g_idx = torch.zeros(256, dtype=torch.int32)  # every row in group 0: not 128 a group
    with pytest.raises(QuantizationConfigError, match="o_proj.g_idx: every group must hold exactly"):
        pack_checkpoint_linear(spec, "o_proj", {**tensors, "g_idx": bad_g_idx})
    fp8 = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(QuantizationConfigError, match=r"down_proj.weight: expected torch.float8_e4m3fn"):
        pack_checkpoint_linear(fp8, "down_proj", {"weight": torch.ones(128, 128), "weight_scale_inv": torch.ones(1, 1)})


# ---- loading helpers ---------------------------------------------------------------------------

def test_group_layer_tensors_and_in_situ_targets():
    spec = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True})
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.qweight", "model.layers.0.self_attn.q_proj.qzeros",
             "model.layers.0.self_attn.q_proj.scales", "model.layers.0.self_attn.q_proj.g_idx",
             "model.layers.0.self_attn.q_proj.bias", "model.layers.0.input_layernorm.weight", "lm_head.weight"]
    layers, rest = group_layer_tensors(names, spec)
    assert layers == {"model.layers.0.self_attn.q_proj": {s: f"model.layers.0.self_attn.q_proj.{s}"
                                                          for s in ("qweight", "qzeros", "scales", "g_idx")}}
    assert rest == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias",
                    "model.layers.0.input_layernorm.weight", "lm_head.weight"]
    fp8 = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    layers, rest = group_layer_tensors(["a.down_proj.weight", "a.down_proj.weight_scale_inv", "a.norm.weight"], fp8)
    assert layers == {"a.down_proj": {"weight": "a.down_proj.weight", "weight_scale_inv": "a.down_proj.weight_scale_inv"}}
    assert rest == ["a.norm.weight"]
    w = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert is_in_situ_target("model.layers.3.mlp.down_proj.weight", w)
    assert not is_in_situ_target("lm_head.weight", w)
    assert not is_in_situ_target("model.embed_tokens.weight", w)
    assert not is_in_situ_target("model.layers.3.self_attn.q_proj.bias", torch.zeros(8))


def test_summary_reports_bits_and_memory():
    w16 = torch.randn(256, 256, dtype=torch.bfloat16)
    packed = quantize_in_situ(w16, "int4")
    summary = summarize({"model.layers.0.mlp.down_proj": packed, "lm_head.weight": w16}, "in-situ int4")
    assert (summary.quantization, summary.bits) == ("in-situ int4", 4)
    assert summary.weight_bytes == packed.nbytes + w16.nbytes == 256 * 128 + 256 * 2 * 2 + 256 * 256 * 2
    assert summary.unquantized_bytes == 2 * w16.nbytes
    assert summary.log_line().startswith("quantization in-situ int4: 4-bit projections, weights 0.00 GB")
    assert summarize({"w": w16}, "in-situ int4").quantization == "none"


@pytest.mark.parametrize("method", ["int4", "fp8"])
def test_packed_linear_over_leading_dims(method):
    gen = torch.Generator().manual_seed(12)
    w = quantize_in_situ(torch.randn(48, 256, generator=gen) * 0.02, method).to(DEVICE)
    x = torch.randn(2, 3, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    res = torch.randn(2, 3, 48, generator=gen).to(torch.bfloat16).to(DEVICE)
    twin = dequantize_packed(w, torch.float64)
    y = packed_linear(x, w, residual=res)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    tol = TOL[torch.bfloat16] if method == "int4" else 0.06  # fp8 also quantizes x
    assert rel_err(y, x.double() @ twin.T.to(DEVICE) + res.double()) < tol


def test_concat_rows_fuses_parts():
    """q/k/v or gate/up stacked: each part keeps its own numbers (zeros, per-tensor fp8 scales)."""
    gen = torch.Generator().manual_seed(13)
    q = quantize_in_situ(torch.randn(32, 256, generator=gen), "int4")
    k_part = IntPackedWeight(4, 128, q.qs[:16].clone(), torch.rand(16, 2, generator=gen).half(),
                             zeros=torch.randint(0, 16, (16, 2), generator=gen).to(torch.uint8))
    fused = concat_rows([q, k_part])
    assert torch.equal(dequantize_int(fused), torch.cat([dequantize_int(q), dequantize_int(k_part)]))
    with pytest.raises(ValueError, match=r"cannot stack 4-bit group 128 \[256 columns\] onto 8-bit group 256"):
        concat_rows([quantize_in_situ(torch.randn(8, 256), "int8"), q])
    a = Fp8Weight((torch.randn(16, 64) * 10).to(FP8_DTYPE), torch.tensor([[0.5]]), 16, 64)
    b = Fp8Weight((torch.randn(8, 64) * 10).to(FP8_DTYPE), torch.tensor([[0.25]]), 8, 64)
    fused = concat_rows([a, b])
    assert (fused.block_n, fused.block_k) == (1, 64)
    assert torch.equal(dequantize_fp8(fused), torch.cat([dequantize_fp8(a), dequantize_fp8(b)]))
    with pytest.raises(ValueError, match="different formats"):
        concat_rows([a, q])
