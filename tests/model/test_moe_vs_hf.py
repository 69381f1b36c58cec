"""Qwen3-MoE and Mixtral: tiny random checkpoints built with transformers' own config classes, against
HF transformers in fp32.

Per case: prefill logits (in chunks over cached blocks) and 32 decode steps through the paged cache
within 1e-4, 32 greedy tokens identical, a batch equal to each prompt alone; routing ties resolved as
HF resolves them; the same model loaded from every expert layout (per-expert, Mixtral's w1/w2/w3,
HF's stacked gate_up_proj, GGUF-style stacked gate/up/down) gives the same logits."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import PagedHarness
from tiny_models import VOCAB_SIZE, make_hf_model, save_hf_model

transformers = pytest.importorskip("transformers")

from inference_service.errors import UnsupportedModelError  # noqa: E402
from inference_service.model.loader import load_model  # noqa: E402
from inference_service.model.moe import SparseMoE, route  # noqa: E402

NUM_DECODE = 32
CASES = {
    # 8 experts, 3 per token, renormalized; layer 1 dense (decoder_sparse_step=2 makes layers 1, 3 sparse;
    # mlp_only_layers takes 3 back), so dense and sparse layers mix.
    "qwen3_moe_norm": ("qwen3_moe", dict(norm_topk_prob=True, num_hidden_layers=4, decoder_sparse_step=2,
                                         mlp_only_layers=[3])),
    "qwen3_moe": ("qwen3_moe", dict(norm_topk_prob=False)),
    "mixtral": ("mixtral", {}),
}
PROMPT = [int(x) for x in torch.randint(3, VOCAB_SIZE, (37,), generator=torch.Generator().manual_seed(7))]
OTHER_PROMPTS = [PROMPT[5:18], [int(x) for x in torch.randint(3, VOCAB_SIZE, (29,),
                                                              generator=torch.Generator().manual_seed(8))]]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    hf_model = make_hf_model(family, seed=len(request.param), **overrides)
    path = save_hf_model(hf_model, str(tmp_path_factory.mktemp(request.param)))
    return hf_model, load_model(path), path


def _hf_steps(hf_model, prompt: list[int], num_steps: int):
    with torch.inference_mode():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        prefill = out.logits[0]
        tokens, steps = [int(prefill[-1].argmax())], []
        for _ in range(num_steps):
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits[0, -1])
            tokens.append(int(steps[-1].argmax()))
    return prefill, steps, tokens


def test_layers_and_routing_config(case):
    hf_model, loaded, _ = case
    hf_kinds = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf_model.model.layers]
    assert [isinstance(layer.mlp, SparseMoE) for layer in loaded.model.model.layers] == hf_kinds
    moe = next(layer.mlp for layer in loaded.model.model.layers if isinstance(layer.mlp, SparseMoE))
    hf = hf_model.config
    assert (moe.num_experts, moe.top_k, moe.renormalize) == (
        hf.num_local_experts, hf.num_experts_per_tok, getattr(hf, "norm_topk_prob", True))


def test_prefill_and_decode_logits_match(case):
    hf_model, loaded, _ = case
    expected_prefill, expected_steps, tokens = _hf_steps(hf_model, PROMPT, NUM_DECODE)
    harness = PagedHarness(loaded.model, num_blocks=64, block_size=4)
    table = []
    got = torch.cat([harness.all_logits(PROMPT[start:start + 13], start, table) for start in range(0, len(PROMPT), 13)])
    torch.testing.assert_close(got, expected_prefill, atol=1e-4, rtol=1e-4)
    for step, token in enumerate(tokens[:NUM_DECODE]):
        got_step = harness.all_logits([token], len(PROMPT) + step, table)[0]
        torch.testing.assert_close(got_step, expected_steps[step], atol=1e-4, rtol=1e-4,
                                   msg=lambda m, step=step: f"decode step {step}: {m}")


def test_greedy_tokens_match(case):
    hf_model, loaded, _ = case
    _, _, expected = _hf_steps(hf_model, PROMPT, NUM_DECODE - 1)
    got = PagedHarness(loaded.model, num_blocks=64, block_size=4, seed=3).generate([PROMPT], NUM_DECODE)[0]
    assert got == expected


def test_batched_equals_alone(case):
    _, loaded, _ = case
    prompts = [PROMPT, *OTHER_PROMPTS]
    batched = PagedHarness(loaded.model, num_blocks=128, block_size=4, seed=5).generate(prompts, 12, prefill_chunk=9)
    alone = [PagedHarness(loaded.model, num_blocks=64, block_size=4, seed=6).generate([p], 12)[0] for p in prompts]
    assert batched == alone


def _hf_moe_blocks(hf_model):
    return [layer.mlp for layer in hf_model.model.layers if type(layer.mlp).__name__.endswith("SparseMoeBlock")]


def test_routing_ties_resolve_as_hf(tmp_path):
    """Experts 1, 2 and 4 get the same router row, so their probabilities tie exactly for every
    token, and with top-3 of 8 the tie often straddles the cut: which tied expert is taken must be
    HF's choice (the experts differ, so a different choice changes the logits)."""
    hf_model = make_hf_model("qwen3_moe", seed=11, norm_topk_prob=True)
    with torch.no_grad():
        for block in _hf_moe_blocks(hf_model):
            block.gate.weight[1] *= 2.0  # strong enough that the tied trio is often picked
            block.gate.weight[2].copy_(block.gate.weight[1])
            block.gate.weight[4].copy_(block.gate.weight[1])
    loaded = load_model(save_hf_model(hf_model, str(tmp_path)))
    x = torch.randn(64, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    hf_block = _hf_moe_blocks(hf_model)[0]
    ours = next(layer.mlp for layer in loaded.model.model.layers if isinstance(layer.mlp, SparseMoE))
    with torch.inference_mode():
        _, hf_weights, hf_ids = hf_block.gate(x)
        weights, ids = route(ours, x)
    tied = torch.tensor([1, 2, 4])
    num_tied_chosen = torch.isin(ids, tied).sum(dim=-1)
    assert ((num_tied_chosen > 0) & (num_tied_chosen < 3)).any(), "no token has a tie across the cut"
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    got = PagedHarness(loaded.model, num_blocks=64, block_size=4).all_logits(PROMPT, 0, [])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _rewrite(path: str, transform) -> None:
    tensors = load_file(os.path.join(path, "model.safetensors"))
    save_file(transform(tensors), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _stack(tensors: dict, layout: str) -> dict:
    """Per-expert tensors -> HF's stacked gate_up_proj / down_proj ("hf"), or one stacked tensor per
    projection as GGUF's ffn_*_exps hold them ("per_projection")."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            out[name] = tensor
            continue
        prefix, rest = name.split(".experts.")
        expert, proj = rest.split(".")[:2]
        experts.setdefault(prefix.replace("block_sparse_moe", "mlp"), {}).setdefault(
            {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(proj, proj), {})[int(expert)] = tensor
    for prefix, projs in experts.items():
        stacked = {proj: torch.stack([rows[e] for e in sorted(rows)]) for proj, rows in projs.items()}
        if layout == "hf":
            out[f"{prefix}.experts.gate_up_proj"] = torch.cat((stacked["gate_proj"], stacked["up_proj"]), dim=1)
            out[f"{prefix}.experts.down_proj"] = stacked["down_proj"]
        else:
            out.update({f"{prefix}.experts.{proj}.weight": t for proj, t in stacked.items()})
    return out


@pytest.mark.parametrize("layout", ["hf", "per_projection"])
def test_stacked_expert_layouts_load_the_same_model(case, layout, tmp_path):
    _, loaded, path = case
    for name in os.listdir(path):
        os.link(os.path.join(path, name), tmp_path / name) if name != "model.safetensors" else None
    tensors = load_file(os.path.join(path, "model.safetensors"))
    save_file(_stack(tensors, layout), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    stacked = load_model(str(tmp_path))
    expected = PagedHarness(loaded.model, num_blocks=16, block_size=4).all_logits(PROMPT[:11], 0, [])
    got = PagedHarness(stacked.model, num_blocks=16, block_size=4).all_logits(PROMPT[:11], 0, [])
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_missing_expert_is_named(case, tmp_path):
    _, _, path = case
    for name in os.listdir(path):
        if name != "model.safetensors":
            os.link(os.path.join(path, name), tmp_path / name)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    dropped = next(name for name in tensors if ".experts.1." in name and name.endswith(("up_proj.weight", "w3.weight")))
    del tensors[dropped]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    layer = dropped.split(".")[2]
    with pytest.raises(UnsupportedModelError, match=rf"lacks weights: .*model\.layers\.{layer}\.mlp\.experts\.gate_up_proj"):
        load_model(str(tmp_path))


# ---------------------------------------------------------------------- GGUF round trip

_GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                     "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                     "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                     "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
                     "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
                     "mlp.experts.down_proj": "ffn_down_exps"}


def _llama_cpp_permute(weight, num_heads: int):
    """llama.cpp's converter's q/k row order for llama-architecture files (Mixtral)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _write_moe_gguf(hf_model, path: str, quantize_attention: bool = False) -> None:
    """The model as llama.cpp's converter writes it: qwen3moe, or Mixtral as `llama` with experts
    (attention projections in Q8_0 blocks with `quantize_attention`)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    from inference_service.model.tokenizer import bytes_to_unicode

    config, is_mixtral = hf_model.config, hf_model.config.model_type == "mixtral"
    writer = GGUFWriter(path, "llama" if is_mixtral else "qwen3moe")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if not is_mixtral:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    tokens = list(bytes_to_unicode().values()) + ["<s>", "</s>"]
    tokens += [f"<extra_{i}>" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    state = {}
    for name, tensor in hf_model.state_dict().items():  # in memory, transformers holds the experts stacked
        if name.endswith(".experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            state[name.replace("gate_up_proj", "gate_proj")], state[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            state[name] = tensor
    for name, tensor in state.items():
        array = tensor.numpy().astype(np.float32)
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.weight"
            if is_mixtral and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if module == "self_attn.q_proj" else config.num_key_value_heads
                array = _llama_cpp_permute(array, heads)
        if quantize_attention and ".attn_" in gguf_name and "norm" not in gguf_name:
            blocks = quantize(np.ascontiguousarray(array), GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType.Q8_0)
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gguf_round_trip(family, tmp_path):
    pytest.importorskip("gguf")
    # llama.cpp always renormalizes the top-k weights: so does the HF model here.
    hf_model = make_hf_model(family, seed=21, **({"norm_topk_prob": True} if family == "qwen3_moe" else {}))
    path = str(tmp_path / f"tiny-{family}.gguf")
    _write_moe_gguf(hf_model, path)
    loaded = load_model(path)
    assert (loaded.config.model_type, loaded.config.num_experts, loaded.config.num_experts_per_tok) == (
        family, hf_model.config.num_local_experts, hf_model.config.num_experts_per_tok)
    _, expected_steps, tokens = _hf_steps(hf_model, PROMPT, 4)
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    harness = PagedHarness(loaded.model, num_blocks=32, block_size=4)
    table = []
    torch.testing.assert_close(harness.all_logits(PROMPT, 0, table), expected, atol=1e-4, rtol=1e-4)
    for step, token in enumerate(tokens[:4]):
        torch.testing.assert_close(harness.all_logits([token], len(PROMPT) + step, table)[0], expected_steps[step],
                                   atol=1e-4, rtol=1e-4)


def test_engine_serves_a_mixtral_gguf_with_quantized_attention(tmp_path):
    """Through the engine (scheduler, model runner, sampler) on the CPU: a Mixtral GGUF whose attention
    projections are Q8_0 blocks run in place (the C++ decode layers do not take MoE MLPs and must
    stand aside), greedy tokens equal to our model's own paged greedy decode, batched and alone."""
    pytest.importorskip("gguf")
    from prometheus_client import CollectorRegistry

    from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig
    from inference_service.engine.llm_engine import LLMEngine
    from inference_service.engine.sampling_params import SamplingParams
    from inference_service.metrics import EngineMetrics

    hf_model = make_hf_model("mixtral", seed=23)
    path = str(tmp_path / "tiny-mixtral.gguf")
    _write_moe_gguf(hf_model, path, quantize_attention=True)
    loaded = load_model(path)
    assert loaded.model.model.layers[0].self_attn.qkv_proj.quantized  # kept in Q8_0 blocks
    engine = LLMEngine(EngineConfig(cache=CacheConfig(kv_cache_memory_mib=16), scheduler=SchedulerConfig()),
                       loaded=loaded, metrics=EngineMetrics("t", registry=CollectorRegistry()))
    prompts = [PROMPT, *OTHER_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [out.completions[0].token_ids for out in engine.generate(prompts, params)]
    expected = [PagedHarness(loaded.model, num_blocks=64, block_size=4).generate([p], 10)[0] for p in prompts]
    assert got == expected
