"""Tensor-parallel decode graphs: every rank warms up, captures and replays its own graph of each batch size,
the step's broadcasts inside them. On the CPU the graphs are `StepGraph`'s stand-in (a replay runs the
captured body again over the same buffers, collectives included), so the protocol between the ranks runs
under gloo: two ranks replaying graphs give one process's greedy tokens, as one rank replaying them does."""

from __future__ import annotations

import pytest
from harness import PagedHarness
from prometheus_client import CollectorRegistry
from tiny_models import make_hf_model, save_hf_model

from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig
from inference_service.engine import cuda_graphs, model_runner
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.sampling_params import SamplingParams
from inference_service.metrics import EngineMetrics
from inference_service.model.loader import load_model

# Three prompts: decode steps of 3 sequences replay the graph of 4 (one padding row), then of 2 and 1
# as the shorter requests finish.
PROMPTS = [[256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], [256, 84, 80], [256, 9, 31, 7, 7]]
MAX_TOKENS = [9, 5, 3]


@pytest.fixture
def replayed_sizes(monkeypatch):
    """Decode graphs on the CPU (Triton backend, interpreted), and the batch sizes rank 0 replayed."""
    monkeypatch.setattr(model_runner, "uses_decode_graphs", lambda device, config, backend: backend == "triton")
    sizes: list[int] = []
    replay = cuda_graphs.DecodeGraphs.replay

    def counting_replay(self, size):
        sizes.append(size)
        return replay(self, size)

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "replay", counting_replay)
    return sizes


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_decode_graph_replays_give_one_process_eager_tokens(tmp_path, replayed_sizes, tensor_parallel_size):
    path = save_hf_model(make_hf_model("llama", seed=3), str(tmp_path / "llama"))
    reference = PagedHarness(load_model(path).model)
    expected = [reference.generate([p], n)[0] for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    config = EngineConfig(model=path, device="cpu", dtype="float32", tensor_parallel_size=tensor_parallel_size,
                          attention_backend="triton", cache=CacheConfig(kv_cache_memory_mib=4),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    engine = LLMEngine(config, metrics=EngineMetrics("tp-graphs", registry=CollectorRegistry()))
    try:
        assert sorted(engine.model_runner.graphs.graphs) == [1, 2, 4]
        outputs = engine.generate(PROMPTS, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                            for n in MAX_TOKENS])
    finally:
        if tensor_parallel_size > 1:
            engine.loaded.model.workers.stop(engine.loaded.model)
    assert [list(o.completions[0].token_ids) for o in outputs] == expected
    # Each decode step replayed: 3 sequences on the graph of 4, then 2 on 2, then 1 on 1.
    assert replayed_sizes == [4] * 2 + [2] * 2 + [1] * 4
