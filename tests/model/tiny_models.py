"""Tiny random-weight HF checkpoints (2 layers, hidden 64) written as safetensors folders."""

from __future__ import annotations

import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from inference_service.model.tokenizer import bytes_to_unicode

VOCAB_SIZE = 300
COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False)


def write_byte_tokenizer(path: str) -> None:
    """A 256-byte BPE vocabulary plus <s> and </s>: enough for the loader, no merges needed."""
    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    vocab.update({"<s>": 256, "</s>": 257})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{{ messages[0]['content'] }}"}, f)


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A random HF model of `family` (qwen2, qwen3, llama, mistral, gemma2, gemma3, phi3, stablelm, glm4,
    qwen3_moe, mixtral)
    with non-trivial weights everywhere."""
    import transformers

    classes = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM),
        "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }
    config_cls, model_cls = classes[family]
    extra = {"head_dim": 16} if family in ("qwen3", "mistral", "gemma2", "gemma3", "glm4", "qwen3_moe",
                                           "mixtral") else {}
    if family == "qwen3_moe":
        extra.update(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32)
    if family == "mixtral":
        extra.update(num_local_experts=6, num_experts_per_tok=2, intermediate_size=48, sliding_window=None)
    if family == "mistral":
        extra["sliding_window"] = None
    if family in ("gemma2", "gemma3", "phi3", "stablelm", "glm4"):
        extra.update(pad_token_id=0, bos_token_id=256, eos_token_id=257)
    if family == "stablelm":
        extra["layer_norm_eps"] = 1e-5
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms scale by (1 + weight): near 0 there is near 1 here.
                param.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(param))
            else:
                # Larger than HF's init so logits are well separated and greedy choices are stable.
                param.copy_(0.15 * torch.randn_like(param))
    return model


def save_hf_model(model, path: str) -> str:
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return path


def load_hf_case(name: str, family: str, overrides: dict, tmp_path_factory):
    """(HF model, our LoadedModel of the same saved checkpoint) for one family test case."""
    from inference_service.model.loader import load_model

    hf_model = make_hf_model(family, seed=len(name), **overrides)
    return hf_model, load_model(save_hf_model(hf_model, str(tmp_path_factory.mktemp(name))))
