"""`prompt_logprobs` on the embedded model: every prompt position's logprob, rank and top-k equal a direct
full-prompt forward of the model (float32 log_softmax of its logits), over gRPC with chunked prefill forced
small and with the prompt already in the prefix cache, and in the engine loop under preemption.
Also priority scheduling over gRPC: queued requests start lowest priority value first."""

from __future__ import annotations

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from inference_service.api import pb, pb_grpc
from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.sampling_params import SamplingParams
from inference_service.metrics import EngineMetrics
from inference_service.model.loader import load_model
from tests.grpc_client import GenerateStream, start_engine
from tests.model.harness import PagedHarness

PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
LONG_PROMPT = "The mitochondria is the powerhouse of the cell. " * 6
NUM_TOP = 5


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # Chunks of at most 16 tokens: every prompt here spans several steps.
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = start_engine("--max-num-batched-tokens", "16", "--max-num-seqs", "4", "--kv-cache-memory", "64",
                        log_path=str(log))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stub(engine):
    with grpc.insecure_channel(engine.target) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def reference(loaded, prompt_ids: list[int]) -> torch.Tensor:
    """Logprobs [len(prompt) - 1, vocab] of a direct forward of the whole prompt: row i scores token i + 1."""
    with torch.inference_mode():
        logits = PagedHarness(loaded.model).all_logits(prompt_ids, 0, [])  # [P, vocab]
    return logits.float().log_softmax(dim=-1)[:-1]


def assert_matches_reference(entries, prompt_ids: list[int], ref: torch.Tensor, tokenizer=None) -> None:
    """`entries` (proto or engine TokenLogprob) equal the reference: values within 1e-4, top-k ids exact."""
    assert [e.token_id for e in entries] == prompt_ids[1:]
    for i, e in enumerate(entries):
        target = ref[i, prompt_ids[i + 1]].item()
        assert abs(e.logprob - target) < 1e-4, (i, e.logprob, target)
        # The rank is exact up to the tokens whose logprob lies within the tolerance of the target's.
        assert int((ref[i] > target + 1e-4).sum()) + 1 <= e.rank <= int((ref[i] >= target - 1e-4).sum()), i
        values, ids = ref[i].topk(NUM_TOP)
        top = [(t.token_id, t.logprob) if hasattr(t, "token_id") else t for t in e.top_logprobs]
        assert [t for t, _ in top] == ids.tolist(), i
        assert max(abs(v - w) for (_, v), w in zip(top, values.tolist())) < 1e-4, i
        if tokenizer is not None:
            assert e.token == tokenizer.decode([e.token_id], skip_special_tokens=False)


def run_one(stub, request_id: str, prompt: str, n: int = 1, **sampling) -> list[pb.GenerateResponse]:
    """Every response of one greedy 3-token request, up to its last."""
    stream = GenerateStream(stub)
    stream.start(request_id, text=prompt, sampling=pb.SamplingParams(temperature=0.0, **sampling),
                 stopping=pb.StoppingCriteria(max_tokens=3, ignore_eos=True), n=n)
    responses = []
    while not responses or not (responses[-1].HasField("usage") or responses[-1].HasField("error")):
        responses.append(stream.next())
    stream.close()
    return responses


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT], ids=["short", "long"])
def test_prompt_logprobs_equal_a_full_forward_with_chunked_prefill(stub, loaded, prompt):
    responses = run_one(stub, "plp", prompt, prompt_logprobs=NUM_TOP)
    assert not any(r.HasField("error") for r in responses)
    prompt_ids = loaded.tokenizer.encode(prompt)
    assert len(prompt_ids) > 16  # the prompt spans several chunks
    # On the first message only; every other message has none.
    assert [len(r.prompt_logprobs) for r in responses] == [len(prompt_ids) - 1] + [0] * (len(responses) - 1)
    assert_matches_reference(responses[0].prompt_logprobs, prompt_ids, reference(loaded, prompt_ids), loaded.tokenizer)


def test_prompt_logprobs_with_the_prompt_in_the_prefix_cache(stub, loaded):
    prompt = "Roses are red, violets are blue. " * 6
    first = run_one(stub, "warm", prompt)
    assert first[-1].usage.cached_tokens == 0 and not first[0].prompt_logprobs
    warm_again = run_one(stub, "warm-again", prompt)
    assert warm_again[-1].usage.cached_tokens >= 32  # the prompt's blocks are cached
    responses = run_one(stub, "plp-cached", prompt, prompt_logprobs=NUM_TOP)
    prompt_ids = loaded.tokenizer.encode(prompt)
    # Positions from the cache would have no logits: the request recomputes its whole prompt.
    assert responses[-1].usage.cached_tokens == 0
    assert_matches_reference(responses[0].prompt_logprobs, prompt_ids, reference(loaded, prompt_ids))


def test_prompt_logprobs_zero_gives_the_prompt_tokens_alone_once_for_n_completions(stub, loaded):
    responses = run_one(stub, "plp0", PROMPT, n=2, prompt_logprobs=0)
    prompt_ids = loaded.tokenizer.encode(PROMPT)
    carrying = [r for r in responses if r.prompt_logprobs]
    assert len(carrying) == 1 and carrying[0].index == 0  # completion 0's first message only
    assert {r.index for r in responses} == {0, 1}
    entries = carrying[0].prompt_logprobs
    ref = reference(loaded, prompt_ids)
    assert [e.token_id for e in entries] == prompt_ids[1:]
    assert all(not e.top_logprobs for e in entries)
    assert max(abs(e.logprob - ref[i, prompt_ids[i + 1]].item()) for i, e in enumerate(entries)) < 1e-4


def test_prompt_logprobs_above_the_bound_are_invalid_argument(stub):
    responses = run_one(stub, "plp-big", PROMPT, prompt_logprobs=21)
    assert len(responses) == 1
    error = responses[0].error
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error.field == "sampling.prompt_logprobs"
    assert "20" in error.message


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_survive_preemption_mid_prefill(loaded, async_scheduling):
    # 4 MiB of KV cache = 5 blocks of 16 tokens, steps of 4 tokens. The first request decodes (one
    # token a step) while the second, arrived later, prefills its 55-token prompt 3 tokens a step: when
    # the first needs its third block (token 33) the second holds three (42 tokens), so the second is
    # preempted mid-prefill, and recomputed from the first position still without logprobs.
    config = EngineConfig(cache=CacheConfig(kv_cache_memory_mib=4),
                          scheduler=SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=2),
                          async_scheduling=async_scheduling)
    engine = LLMEngine(config, loaded=loaded, metrics=EngineMetrics("test", registry=CollectorRegistry()))
    assert engine.block_manager.num_blocks == 5
    long_run = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with_plp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=NUM_TOP)
    outputs = engine.generate([PROMPT, LONG_PROMPT], [long_run, with_plp])
    assert engine.scheduler.num_preemptions > 0
    prompt_ids = loaded.tokenizer.encode(LONG_PROMPT)
    assert len(prompt_ids) == 55
    assert_matches_reference(outputs[1].completions[0].prompt_logprobs, prompt_ids, reference(loaded, prompt_ids))
