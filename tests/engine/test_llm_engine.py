"""The engine loop on the embedded model: batch invariance, preemption, n > 1, stop strings."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.sequence import FinishReason
from inference_service.metrics import EngineMetrics
from inference_service.model.loader import load_model

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3,",
    "The capital of Germany is",
    "Water boils at",
    "import numpy as np\nimport torch\n\n",
    "In 1492,",
    "Photosynthesis is the process by which plants",
    "Dear Sir or Madam,",
    "The best way to learn a language is",
    "SELECT * FROM users WHERE",
    "Roses are red,",
    "Q: What is 2+2?\nA:",
    "The mitochondria is the powerhouse of the cell. " * 6,
    "Hello",
]


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def make_engine(loaded, num_blocks_mib: int = 64, async_scheduling: bool = False, **scheduler) -> LLMEngine:
    config = EngineConfig(cache=CacheConfig(kv_cache_memory_mib=num_blocks_mib),
                          scheduler=SchedulerConfig(**scheduler), async_scheduling=async_scheduling)
    return LLMEngine(config, loaded=loaded, metrics=EngineMetrics("test", registry=CollectorRegistry()))


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> dict[str, dict]:
    """`engine.generate` over every prompt at once (with its own params if given a list); returns
    tokens/text/finish/usage/logprobs by id (r0, r1, ... in prompt order), each by completion index."""
    results: dict[str, dict] = {}
    for i, output in enumerate(engine.generate(prompts, params)):
        r = results[f"r{i}"] = {"tokens": {}, "text": {}, "finish": {}, "usage": output.usage, "logprobs": {}}
        for c in output.completions:
            r["tokens"][c.index], r["text"][c.index], r["finish"][c.index] = c.token_ids, c.text, c.finish_reason
            if c.logprobs:
                r["logprobs"][c.index] = c.logprobs
    return results


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_float16_kv_cache_holds_twice_the_blocks_and_decodes_the_same(loaded):
    """`--kv-cache-dtype fp16` end to end: the same MiB hold twice the blocks, and greedy generation (prefills,
    prefix hits, batched decodes) gives the float32 cache's tokens on these prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fp32 = make_engine(loaded)
    config = EngineConfig(cache=CacheConfig(kv_cache_memory_mib=64, kv_cache_dtype="fp16"))
    fp16 = LLMEngine(config, loaded=loaded, metrics=EngineMetrics("test", registry=CollectorRegistry()))
    assert fp16.model_runner.kv_caches[0][0].dtype == torch.float16
    assert fp16.block_manager.num_blocks == 2 * fp32.block_manager.num_blocks
    assert run(fp16, PROMPTS, params) == run(fp32, PROMPTS, params)
    assert_all_blocks_free(fp16)


def test_sixteen_concurrent_equal_each_alone(loaded):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = make_engine(loaded)
    alone = {f"r{i}": run(engine, [p], params)["r0"]["tokens"][0] for i, p in enumerate(PROMPTS)}
    together = run(engine, PROMPTS, params)
    for rid, tokens in alone.items():
        assert together[rid]["tokens"][0] == tokens, rid
        assert together[rid]["usage"].completion_tokens == 24
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_gives_the_same_greedy_output(loaded, async_scheduling):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = PROMPTS[:8]
    reference = run(make_engine(loaded), prompts, params)
    # 6 MiB of KV cache = 8 blocks of 16 tokens (720 KiB each): 8 sequences of ~60 tokens need 32.
    small = make_engine(loaded, num_blocks_mib=6, async_scheduling=async_scheduling)
    assert small.block_manager.num_blocks == 8
    preempted = run(small, prompts, params)
    assert small.scheduler.num_preemptions > 0
    for rid in reference:
        assert preempted[rid]["tokens"] == reference[rid]["tokens"], rid
    assert_all_blocks_free(small)


def test_chunked_prefill_gives_the_same_greedy_output(loaded):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = [PROMPTS[14], PROMPTS[2]]
    reference = run(make_engine(loaded), prompts, params)
    chunked = run(make_engine(loaded, max_num_batched_tokens=20, max_prefill_chunk=7, max_num_seqs=4), prompts, params)
    for rid in reference:
        assert chunked[rid]["tokens"] == reference[rid]["tokens"], rid


def test_n_completions_share_prompt_blocks(loaded):
    engine = make_engine(loaded)
    prompt = PROMPTS[14]  # 60+ tokens: several full blocks
    request = engine.input_processor.process("n", prompt, SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=4))
    engine.add_request(request)
    engine.step()  # all four prefilled in one step
    seqs = engine.requests["n"].seqs
    num_full = (len(request.prompt_token_ids) - 1) // 16
    first_blocks = seqs[0].block_table[:num_full]
    for seq in seqs[1:]:
        assert seq.block_table[:num_full] == first_blocks
    for block_id in first_blocks:
        assert engine.block_manager.blocks[block_id].ref_count == 4
    engine.run_until_idle()
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_string_spanning_tokens_is_not_emitted(loaded, async_scheduling):
    engine = make_engine(loaded, async_scheduling=async_scheduling)
    base = run(engine, ["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=12))["r0"]
    text = base["text"][0]
    stop = text[text.index("6") - 1 : text.index("6") + 3]  # e.g. " 6, " spans several tokens
    stopped = run(engine, ["1, 2, 3, 4,"], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))["r0"]
    assert stopped["text"][0] == text[: text.index(stop)]
    assert stopped["finish"][0] == FinishReason.STOP
    assert_all_blocks_free(engine)


def test_seeded_sampling_is_batch_independent(loaded):
    engine = make_engine(loaded)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    alone = run(engine, [PROMPTS[0]], seeded)["r0"]["tokens"][0]
    mixed = run(engine, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], seeded)["r1"]["tokens"][0]
    assert alone == mixed


def test_async_scheduling_gives_the_same_outputs(loaded):
    """Every stop rule, sampling option and penalty (which makes the engine wait for the step in
    flight) in one batch, with chunked prefill: the same tokens, text, logprobs and usage."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    base = run(make_engine(loaded), ["1, 2, 3, 4,", PROMPTS[13]], greedy)
    text, stop_token = base["r0"]["text"][0], base["r1"]["tokens"][0][4]
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token]),  # ends like EOS
        SamplingParams(temperature=0.0, max_tokens=12, stop=[text[text.index("6"):text.index("6") + 2]]),
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, min_tokens=3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=8, top_k=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]
    prompts = [PROMPTS[13], "1, 2, 3, 4,", PROMPTS[6], PROMPTS[0], PROMPTS[14], PROMPTS[3]]
    kwargs = {"max_num_batched_tokens": 32, "max_prefill_chunk": 24, "max_num_seqs": 8}
    reference = run(make_engine(loaded, **kwargs), prompts, mixed)
    engine = make_engine(loaded, async_scheduling=True, **kwargs)
    assert run(engine, prompts, mixed) == reference
    assert reference["r0"]["tokens"][0][-1] == stop_token and reference["r0"]["finish"][0] == FinishReason.STOP
    assert reference["r1"]["finish"][0] == FinishReason.STOP
    assert not engine.has_unfinished
    assert_all_blocks_free(engine)


def test_async_abort_while_a_step_is_in_flight(loaded):
    engine = make_engine(loaded, async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for rid in ("a", "b"):
        engine.add_request(engine.input_processor.process(rid, PROMPTS[0], params))
    assert engine.step() == []  # the prefill is launched, its tokens not yet processed
    first = engine.step()
    assert [(d.request_id, len(d.token_ids)) for d in first] == [("a", 1), ("b", 1)]
    [final] = engine.abort_request("a")
    assert final.finish_reason == FinishReason.ABORT and final.usage.completion_tokens == 1
    later = engine.run_until_idle()
    assert {d.request_id for d in later} == {"b"} and later[-1].usage.completion_tokens == 30
    assert_all_blocks_free(engine)
