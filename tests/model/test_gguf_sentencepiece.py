"""A GGUF with a SentencePiece vocabulary (`tokenizer.ggml.model = llama`, as Llama-2 and Mistral v0.3
files have), written by the `gguf` package from a tiny random Llama: our tokenizer encodes and decodes
as transformers' reading of the same file, and our logits equal HF's for it."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from harness import PagedHarness, build_metadata
from inference_service.engine.generation_config import load_generation_defaults
from inference_service.model.loader import load_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

WORDS = ["\u2581the", "\u2581hello", "\u2581world", "\u2581token", "\u2581a", "ing", "er", "\u2581new", "\u2581line"]
TEXTS = ["hello world", "the new token", " leading space and ünïcödé ☃", "a\nnew line\n\ttabbed", "tokening er"]


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]  # UNKNOWN, CONTROL
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256  # BYTE
    pieces = dict.fromkeys(["\u2581", *"abcdefghijklmnopqrstuvwxyz"])
    for word in WORDS:
        pieces.update(dict.fromkeys(word[:i] for i in range(1, len(word) + 1)))
    tokens += list(pieces)
    types += [1] * len(pieces)  # NORMAL
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    tokens, scores, types = _vocab()
    config = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.15 * torch.randn_like(param))
    path = str(tmp_path_factory.mktemp("sp") / "tiny-sp.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_float32("general.sampling.temp", 0.25)  # the sampling defaults llama.cpp's converter writes
    writer.add_int32("general.sampling.top_k", 5)
    writer.add_float32("general.sampling.top_p", 0.5)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, param in model.state_dict().items():
        array = param.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.rsplit(".", 1)[0]
            gguf_name = f"blk.{layer}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                array = _permute(array, 4)
            elif module == "self_attn.k_proj":
                array = _permute(array, 2)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def hf_from_gguf(gguf_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tokenizer, model


def test_tokenizer_matches_transformers(gguf_path, hf_from_gguf):
    hf_tokenizer, _ = hf_from_gguf
    ours = load_model(gguf_path).tokenizer
    for text in TEXTS:
        expected = hf_tokenizer.encode(text)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == hf_tokenizer.decode(expected, skip_special_tokens=True), text
    # Byte fallback: a character outside the vocabulary is its UTF-8 bytes, as <0xE2><0x98><0x83>.
    assert ours.convert_ids_to_tokens(ours.encode("☃", add_special_tokens=False)) == ["\u2581", "<0xE2>", "<0x98>",
                                                                                        "<0x83>"]
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos_token) == (1, 2, True)


def test_logits_match_transformers(gguf_path, hf_from_gguf):
    hf_tokenizer, hf_model = hf_from_gguf
    loaded = load_model(gguf_path)
    ids = loaded.tokenizer.encode(TEXTS[2])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0]
    harness = PagedHarness(loaded.model, num_blocks=32, block_size=4)
    table = []
    harness._ensure_blocks(table, len(ids))
    metadata = build_metadata([0], [len(ids)], [table], harness.block_size)
    got = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), harness.kv_caches, metadata))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_sampling_defaults_come_from_the_metadata_the_loader_read(gguf_path):
    loaded = load_model(gguf_path)
    assert {k: v for k, v in loaded.gguf_metadata.items() if k.startswith("general.sampling.")} == {
        "general.sampling.temp": 0.25, "general.sampling.top_k": 5, "general.sampling.top_p": 0.5}
    assert not any(isinstance(v, list) for v in loaded.gguf_metadata.values())  # the vocabulary is not kept twice
    expected = {"temperature": 0.25, "top_k": 5, "top_p": 0.5}
    assert load_generation_defaults("auto", loaded.model_path, gguf_metadata=loaded.gguf_metadata).as_dict() == expected
    assert load_generation_defaults("auto", loaded.model_path).as_dict() == expected  # read from the file
