"""The engine's facade: typed commands, offline `generate` against the streaming path, `EngineInfo`."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.commands import AbortRequest
from inference_service.engine.info import EngineInfo, ModelInfo
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.sequence import FinishReason
from inference_service.metrics import EngineMetrics
from inference_service.model.loader import load_model

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "1, 2, 3,"]


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def make_engine(loaded, **scheduler) -> LLMEngine:
    config = EngineConfig(served_model_name="facade-test", cache=CacheConfig(kv_cache_memory_mib=6),
                          scheduler=SchedulerConfig(**scheduler), async_scheduling=False, max_model_len=512)
    return LLMEngine(config, loaded=loaded, metrics=EngineMetrics("test", registry=CollectorRegistry()))


async def stream_tokens(engine: AsyncEngine, request) -> tuple[list[int], FinishReason | None]:
    tokens, finish = [], None
    async for delta in engine.generate(request):
        tokens += delta.token_ids
        finish = delta.finish_reason or finish
    return tokens, finish


def test_engine_info_holds_the_built_sizes_and_limits(loaded):
    engine = make_engine(loaded, max_num_seqs=7, max_num_batched_tokens=300, max_waiting_requests=9)
    # 6 MiB of KV cache = 8 blocks of 16 tokens (720 KiB each) on the embedded model.
    assert engine.info() == EngineInfo(
        model=ModelInfo(name="facade-test", family="llama", architecture="LlamaForCausalLM", vocab_size=49152,
                        model_path=loaded.model_path, dtype="float32", device="cpu", quantization="gguf",
                        quantization_bits=4, weight_bytes=loaded.model.num_weight_bytes),
        max_model_len=512, max_seq_tokens=128, block_size=16, num_blocks=8, enable_prefix_caching=True,
        max_num_seqs=7, max_num_batched_tokens=300, max_waiting_requests=9, is_async_scheduling=False,
    )
    load = engine.load()
    assert (load.num_waiting, load.num_running, load.num_free_blocks, load.kv_cache_usage) == (0, 0, 8, 0.0)
    engine.add_request(engine.input_processor.process("a", "x" * 20, SamplingParams(max_tokens=4)))
    assert engine.load().num_waiting == 1
    engine.step()
    load = engine.load()
    assert (load.num_waiting, load.num_running) == (0, 1) and load.kv_cache_usage == 1 - load.num_free_blocks / 8 > 0
    engine.run_until_idle()
    assert engine.load().num_free_blocks == 8


async def test_generate_gives_the_streaming_paths_tokens(loaded):
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    offline = make_engine(loaded).generate(PROMPTS, params)
    assert [len(o.completions[0].token_ids) for o in offline] == [10, 8, 6]
    assert [o.usage.completion_tokens for o in offline] == [10, 8, 6]
    streaming_engine = make_engine(loaded)
    engine = AsyncEngine(streaming_engine)
    engine.start()
    try:
        requests = [streaming_engine.input_processor.process(f"s{i}", p, params[i]) for i, p in enumerate(PROMPTS)]
        streamed = await asyncio.gather(*(stream_tokens(engine, r) for r in requests))
    finally:
        await engine.stop()
    assert [tokens for tokens, _ in streamed] == [o.completions[0].token_ids for o in offline]
    assert [finish for _, finish in streamed] == [FinishReason.LENGTH] * 3


async def test_an_unknown_command_is_an_error_and_aborts_nothing(loaded):
    llm_engine = make_engine(loaded)
    engine = AsyncEngine(llm_engine)
    engine.start()
    try:
        request = llm_engine.input_processor.process("r", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                                                     ignore_eos=True))
        deltas = engine.generate(request)
        first = await anext(deltas)  # the request is in the engine
        for command in (("abort", "r"), "r", AbortRequest):
            with pytest.raises(TypeError, match="not an engine command"):
                engine.send(command)
        rest = [delta async for delta in deltas]
    finally:
        await engine.stop()
    assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 12
    assert rest[-1].finish_reason == FinishReason.LENGTH and rest[-1].usage.completion_tokens == 12
