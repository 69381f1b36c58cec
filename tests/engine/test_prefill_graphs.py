"""Prefill graphs: a whole fresh prompt padded to a captured length gives the eager step's logits and cache.

On the CPU a `StepGraph` replays its captured body over the same buffers (the engine itself captures only on a
GPU), so the padding, the captured metadata and the last-row pick are checked here; the engine-level check of a
GPU (graphs on vs off, greedy tokens) is the last test here.
"""

from __future__ import annotations

import json

import pytest
import torch

from inference_service.engine.prefill_graphs import PrefillGraphs, prefill_graph_sizes
from inference_service.engine.step_inputs import StepInputs
from inference_service.model.dummy import load_dummy_model
from kernels._common import is_interpreter
from test_step_inputs import _scheduled, _seq

BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM = 16, 40, 1, 32


def test_captured_lengths_are_128_apart_up_to_the_limit():
    assert prefill_graph_sizes(2048) == [128 * i for i in range(1, 17)]
    assert prefill_graph_sizes(300) == [128, 256]
    assert prefill_graph_sizes(100) == []


def test_prepare_pads_a_prompts_token_rows_only():
    inputs = StepInputs(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=8, block_size=4, device=torch.device("cpu"))
    seq = _seq(list(range(100, 110)), [5, 2, 7], num_computed=0)
    ids, positions, md = inputs.prepare([_scheduled(seq, 10, True)], pad_tokens_to=16)
    assert ids.tolist() == list(range(100, 110)) + [0] * 6
    assert positions.tolist() == list(range(10)) + [0] * 6
    assert md.slot_mapping.tolist()[10:] == [-1] * 6  # padding writes no cache slot
    assert md.query_start_loc.tolist() == [0, 10] and md.seq_lens.tolist() == [10]  # the prompt's own lengths


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "vocab_size": 96, "head_dim": HEAD_DIM, "rope_theta": 10000.0, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6}
    (path / "config.json").write_text(json.dumps(config))
    # the GPU backend (Triton, interpreted here): the torch backend plans its cache writes from host-side values
    return load_dummy_model(str(path), device="cpu", dtype=torch.float32, seed=3, attention_backend="triton")[1]


def _caches(model):
    return [(torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM),
             torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)) for _ in range(model.config.num_hidden_layers)]


@pytest.mark.skipif(not is_interpreter(), reason="the CPU stand-in of a graph, with Triton's interpreter")
@pytest.mark.parametrize("num_tokens", [20, 32, 2])
def test_replay_equals_the_eager_step(model, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    prompt = torch.randint(0, 96, (num_tokens,), generator=gen).tolist()
    block_table = (torch.randperm(NUM_BLOCKS - 1, generator=gen)[:2] + 1).tolist()  # 32 tokens' blocks
    graph_caches, eager_caches = _caches(model), _caches(model)

    inputs = StepInputs(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=2, block_size=BLOCK_SIZE,
                        device=torch.device("cpu"))

    out = torch.empty(1, 96)  # as the engine's body: the logits land in one persistent buffer

    def forward(ids, pos, md, last_row):
        out.copy_(model.compute_logits(model(ids, pos, graph_caches, md).index_select(0, last_row)))
        return out

    graphs = PrefillGraphs(forward, inputs, [16, 32], torch.device("cpu"))  # the engine's are 128 apart
    assert all(c.abs().sum() == 0 for kv in graph_caches for c in kv)  # capturing wrote no cache slot
    size = graphs.padded_size(num_tokens)
    assert size == (16 if num_tokens <= 16 else 32)
    inputs.prepare([_scheduled(_seq(prompt, block_table, 0), num_tokens, True)], pad_tokens_to=size)
    logits = graphs.replay(size, num_tokens).clone()  # [1, vocab]

    eager_inputs = StepInputs(max_num_tokens=32, max_num_seqs=4, max_blocks_per_seq=2, block_size=BLOCK_SIZE,
                              device=torch.device("cpu"))
    ids, pos, md = eager_inputs.prepare([_scheduled(_seq(prompt, block_table, 0), num_tokens, True)])
    expected = model.compute_logits(model(ids, pos, eager_caches, md)[-1:])
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    for (gk, gv), (ek, ev) in zip(graph_caches, eager_caches, strict=True):
        assert torch.equal(gk, ek) and torch.equal(gv, ev)  # the same slots written, padding none
    assert graphs.padded_size(33) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine captures graphs on a GPU only")
def test_engine_on_a_gpu_gives_the_same_greedy_tokens_with_and_without_prefill_graphs(tmp_path):
    from prometheus_client import CollectorRegistry

    from inference_service.config import CacheConfig, EngineConfig
    from inference_service.engine.llm_engine import LLMEngine
    from inference_service.engine.sampling_params import SamplingParams
    from inference_service.metrics import EngineMetrics

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "head_dim": 64, "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 130, 700, 1500, 2500)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for graph_tokens in (0, 2048):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cuda",
                                        max_prefill_graph_tokens=graph_tokens, cache=CacheConfig(kv_cache_memory_mib=256)),
                           metrics=EngineMetrics("test", registry=CollectorRegistry()))
        assert (engine.model_runner.prefill_graphs is None) == (graph_tokens == 0)
        # one prompt a step: each is a fresh prompt alone, the case the graphs take
        tokens[graph_tokens] = [engine.generate([p], params)[0].completions[0].token_ids for p in prompts]
    assert tokens[2048] == tokens[0]
