"""Each rank reads only its shard of a safetensors checkpoint: counted at `get_slice`, never `get_tensor`."""

from __future__ import annotations

import pytest
import safetensors
import torch
from tiny_models import make_hf_model, save_hf_model

from inference_service.distributed.shard_reader import ShardedSafetensors
from inference_service.distributed.sharding import ShardPlan
from inference_service.errors import UnsupportedModelError
from inference_service.model.config import ModelConfig
from inference_service.model.loader import _safetensors_files, load_model


class _CountingSlice:
    def __init__(self, inner, counter: dict):
        self.inner, self.counter = inner, counter

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        part = self.inner[index]
        self.counter["bytes"] += part.numel() * part.element_size()
        return part


class _CountingFile:
    def __init__(self, inner, counter: dict):
        self.inner, self.counter = inner, counter

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_slice(self, name):
        return _CountingSlice(self.inner.get_slice(name), self.counter)

    def get_tensor(self, name):
        raise AssertionError(f"the whole of {name!r} was read")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_model("llama", seed=1, num_key_value_heads=1, vocab_size=301)
    path = save_hf_model(hf, str(tmp_path_factory.mktemp("tp_llama")))
    return path, {name: t.detach().clone() for name, t in hf.state_dict().items()}


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_reads_only_its_slices(checkpoint, rank, monkeypatch):
    path, full = checkpoint
    config = load_model(path).config
    counter = {"bytes": 0}
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _CountingFile(real_open(*a, **k), counter))
    plan = ShardPlan(config, rank, 2)
    shards = dict(ShardedSafetensors(_safetensors_files(path), plan, torch.float32))

    d, q, inter = config.head_dim, config.q_size, config.intermediate_size
    vocab = (0, 151) if rank == 0 else (151, 301)
    expected_bytes = 0
    for name, tensor in full.items():
        if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight", "o_proj.weight",
                          "down_proj.weight")):
            expected_bytes += tensor.numel() * 4 // 2
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            expected_bytes += (vocab[1] - vocab[0]) * config.hidden_size * 4
        else:  # norms, and k / v of the one KV head every rank keeps
            expected_bytes += tensor.numel() * 4
    assert counter["bytes"] == expected_bytes
    assert counter["bytes"] < 0.6 * sum(t.numel() * 4 for t in full.values())

    layer = "model.layers.1."
    assert torch.equal(shards[layer + "self_attn.q_proj.weight"],
                       full[layer + "self_attn.q_proj.weight"][rank * q // 2:(rank + 1) * q // 2])
    assert torch.equal(shards[layer + "self_attn.k_proj.weight"], full[layer + "self_attn.k_proj.weight"][:d])
    assert torch.equal(shards[layer + "self_attn.o_proj.weight"],
                       full[layer + "self_attn.o_proj.weight"][:, rank * q // 2:(rank + 1) * q // 2])
    assert torch.equal(shards[layer + "mlp.down_proj.weight"],
                       full[layer + "mlp.down_proj.weight"][:, rank * inter // 2:(rank + 1) * inter // 2])
    embed = shards["model.embed_tokens.weight"]
    assert embed.shape == (151, config.hidden_size)
    assert torch.equal(embed[:vocab[1] - vocab[0]], full["model.embed_tokens.weight"][vocab[0]:vocab[1]])
    assert not embed[vocab[1] - vocab[0]:].any()  # the last rank's padding row


def _config(**overrides) -> ModelConfig:
    base = {"model_type": "llama", "architecture": "LlamaForCausalLM", "vocab_size": 300, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16}
    return ModelConfig(**{**base, **overrides})


@pytest.mark.parametrize(("size", "overrides", "message"), [
    (3, {}, "--tensor-parallel-size 3 does not divide the model's 4 attention heads"),
    (4, {"num_key_value_heads": 3, "num_attention_heads": 12},
     "--tensor-parallel-size 4 neither divides nor is a multiple of the model's 3 KV heads"),
    (2, {"intermediate_size": 129}, "--tensor-parallel-size 2 does not divide the model's MLP size 129"),
])
def test_bad_size_is_a_clear_error(size, overrides, message):
    with pytest.raises(UnsupportedModelError) as e:
        ShardPlan(_config(**overrides), 0, size)
    assert str(e.value) == message
