"""vLLM's extra request fields on the embedded model: allowed_token_ids, bad_words, truncate_prompt_tokens,
include_stop_str_in_output and priority scheduling, in the engine loop (sync and async scheduling)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig
from inference_service.engine.input_processor import bad_words_token_ids
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.logits_processors import banned_last_tokens
from inference_service.engine.sampling_params import SamplingParams
from inference_service.errors import InvalidRequestError
from inference_service.metrics import EngineMetrics
from inference_service.model.loader import load_model

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def make_engine(loaded, async_scheduling: bool = False, **scheduler) -> LLMEngine:
    config = EngineConfig(cache=CacheConfig(kv_cache_memory_mib=64), scheduler=SchedulerConfig(**scheduler),
                          async_scheduling=async_scheduling)
    return LLMEngine(config, loaded=loaded, metrics=EngineMetrics("test", registry=CollectorRegistry()))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(loaded, request):
    return make_engine(loaded, async_scheduling=request.param)


def greedy(max_tokens: int = 24, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **fields)


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_allowed_token_ids_restrict_every_token(engine):
    free = engine.generate([PROMPT], greedy())[0].completions[0].token_ids
    allowed = sorted(set(free[3:6]) | {11, 1234})  # not the first greedy token: the mask must bite
    out = engine.generate([PROMPT], greedy(allowed_token_ids=allowed))[0].completions[0]
    assert out.token_ids and set(out.token_ids) <= set(allowed)
    assert out.token_ids[0] != free[0] or free[0] in allowed


def test_allowed_token_ids_out_of_vocab_is_refused(engine):
    vocab = engine.loaded.config.vocab_size
    with pytest.raises(InvalidRequestError) as e:
        engine.input_processor.process("x", PROMPT, greedy(allowed_token_ids=[1, vocab]))
    assert e.value.field == "sampling.allowed_token_ids[1]"


def test_bad_words_rule_matches_vllm():
    words = [[5], [7, 8], [1, 2, 3]]
    assert banned_last_tokens(words, []) == [5]  # [7, 8] needs 7 before it
    assert banned_last_tokens(words, [4, 7]) == [5, 8]
    assert banned_last_tokens(words, [1, 2]) == [3, 5]
    assert banned_last_tokens(words, [2, 1]) == [5]


def test_bad_words_are_never_generated(engine):
    tokenizer = engine.tokenizer
    free = engine.generate([PROMPT], greedy())[0].completions[0]
    assert " Rome" in free.text  # what the ban must change
    banned = bad_words_token_ids(tokenizer, ["Rome", "capital of"])
    assert any(len(ids) > 1 for ids in banned)  # the multi-token rule is exercised too
    out = engine.generate([PROMPT], greedy(bad_words=["Rome", "capital of"]))[0].completions[0]
    assert "Rome" not in out.text and "capital of" not in out.text
    for ids in banned:
        assert not contains(out.token_ids, ids), (ids, out.token_ids)
    assert out.token_ids != free.token_ids


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    ids = engine.tokenizer.encode(PROMPT)
    out = engine.generate([PROMPT], greedy(8, truncate_prompt_tokens=6))[0]
    alone = engine.generate([ids[-6:]], greedy(8))[0]
    assert out.usage.prompt_tokens == 6
    assert out.completions[0].token_ids == alone.completions[0].token_ids
    with pytest.raises(InvalidRequestError) as e:
        greedy(truncate_prompt_tokens=0)
    assert e.value.field == "truncate_prompt_tokens"


def test_include_stop_str_in_output(engine):
    free = engine.generate([PROMPT], greedy())[0].completions[0].text
    stop = free.strip().split()[0][:3]
    cut = engine.generate([PROMPT], greedy(stop=[stop]))[0].completions[0]
    kept = engine.generate([PROMPT], greedy(stop=[stop], include_stop_str_in_output=True))[0].completions[0]
    assert cut.stop_reason == kept.stop_reason == stop
    assert not cut.text.endswith(stop)
    assert kept.text == cut.text + stop


def test_priority_policy_admits_lowest_value_first(loaded):
    engine = make_engine(loaded, max_num_seqs=1, policy="priority")
    order: list[str] = []
    engine.add_request(engine.input_processor.process("first", PROMPT, greedy(4)))
    engine.step()  # "first" holds the only slot
    for request_id, priority in (("p5", 5), ("p1a", 1), ("p-3", -3), ("p1b", 1)):
        engine.add_request(engine.input_processor.process(request_id, PROMPT, greedy(4), priority=priority))
    for delta in engine.run_until_idle():
        if delta.request_id not in order:
            order.append(delta.request_id)
    assert order == ["first", "p-3", "p1a", "p1b", "p5"]


def test_fcfs_policy_ignores_priority(loaded):
    engine = make_engine(loaded, max_num_seqs=1)
    order: list[str] = []
    engine.add_request(engine.input_processor.process("first", PROMPT, greedy(4)))
    engine.step()
    for request_id, priority in (("p5", 5), ("p-3", -3)):
        engine.add_request(engine.input_processor.process(request_id, PROMPT, greedy(4), priority=priority))
    for delta in engine.run_until_idle():
        if delta.request_id not in order:
            order.append(delta.request_id)
    assert order == ["first", "p5", "p-3"]
