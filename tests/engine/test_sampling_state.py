"""Persistent sampling rows: slots written once, freed and reused with exact values; the output history
on the device; a batch of mixed rows samples each row as it would alone; penalties never make a step
wait for the one before it (only structured output does)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from test_llm_engine import PROMPTS, assert_all_blocks_free, loaded, make_engine, run  # noqa: F401 - fixture

from inference_service.engine import sampling_state
from inference_service.engine.sampler import Sampler
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.sampling_state import SamplingState
from inference_service.engine.structured_output import StructuredOutputSpec

PENALIZED = {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": -0.4,
             "logit_bias": {5: 3.0, 9: -2.5}, "min_tokens": 2, "stop_token_ids": [4], "top_k": 7, "top_p": 0.8,
             "min_p": 0.05, "temperature": 0.6, "logprobs": True, "top_logprobs": 3}


def _counts(tokens: list[int], vocab: int) -> list[float]:
    row = [0.0] * vocab
    for t in tokens:
        row[t] += 1.0
    return row


def test_freed_slot_is_reused_and_every_value_overwritten():
    vocab = 12
    state = SamplingState(2, vocab)
    first = state.add_row(SamplingParams(**PENALIZED), [1, 2, 2], [3, 3, 8], None, eos_token_ids=[11])
    other = state.add_row(SamplingParams(temperature=0.0), [0], [1], None)
    assert (first, other, state.num_free_slots) == (0, 1, 0)
    with pytest.raises(RuntimeError, match="all 2 sampling rows are in use"):
        state.add_row(SamplingParams(), [], [], None)
    assert state.counts[first].tolist() == _counts([3, 3, 8], vocab)
    assert state.seen[first].nonzero().flatten().tolist() == [1, 2]
    assert state.bias[first].nonzero().flatten().tolist() == [5, 9]

    state.remove_row(first)
    generator = torch.Generator().manual_seed(3)
    second = state.add_row(SamplingParams(temperature=1.5, frequency_penalty=0.25, seed=3), [7], [6, 6], generator)
    assert second == first and state.num_free_slots == 0
    # Every column of the slot holds the new row's value; the old bias, prompt mask and counts are gone.
    assert state.params[second].tolist() == [1.5, 1.0, 0.0, 1.0, 0.25, 0.0]
    assert state.top_k[second].item() == 0
    assert state.bias[second].tolist() == [0.0] * vocab
    assert state.seen[second].tolist() == [False] * vocab  # no repetition penalty: the prompt is not kept
    assert state.counts[second].tolist() == _counts([6, 6], vocab)
    batch = state.batch([other, second], [1, 2])
    assert [type(p).__name__ for p in batch.processors] == ["Penalties"]  # no bias, no min_tokens left
    assert batch.selection.rows == [1] and batch.selection.generators == [generator]
    assert batch.selection.top_k is None and batch.selection.top_p is None and batch.logprob_rows == []

    # The history grows on the device by the sampled tokens of the rows that keep one.
    state.record_sampled(batch, torch.tensor([4, 10]))
    assert state.counts[second].tolist() == _counts([6, 6, 10], vocab)
    assert state.counts[other].tolist() == [0.0] * vocab


def test_an_all_greedy_batch_uploads_no_slots(monkeypatch):
    """The rows' slots go to the device only for a processor or a sampled row (a copy a step on a GPU)."""
    uploads = []
    to_device = sampling_state.to_device
    monkeypatch.setattr(sampling_state, "to_device", lambda *a, **kw: uploads.append(a[0]) or to_device(*a, **kw))
    state = SamplingState(3, 12)
    greedy = [state.add_row(SamplingParams(temperature=0.0), [1], [], None) for _ in range(2)]
    uploads.clear()
    batch = state.batch(greedy, [0, 0])
    assert batch.all_greedy and not batch.processors and uploads == []
    sampled = state.add_row(SamplingParams(temperature=0.5), [1], [], None)
    uploads.clear()
    batch = state.batch([*greedy, sampled], [0, 0, 0])
    assert batch.selection.rows == [2] and batch.selection.temperature.tolist() == [[0.5]]
    assert uploads.count([*greedy, sampled]) == 1  # the slots, once (beside the sampled rows [2])


def _random_row(rng: random.Random, vocab: int) -> SamplingParams:
    kw = {"temperature": 0.0} if rng.random() < 0.5 else {"temperature": 0.9, "seed": rng.randrange(2**32)}
    if rng.random() < 0.5:
        kw.update(repetition_penalty=rng.choice([1.3, 0.8]), frequency_penalty=rng.choice([0.0, 0.6]),
                  presence_penalty=rng.choice([0.0, -1.0]), logit_bias={rng.randrange(vocab): 4.0})
    return SamplingParams(**kw, logprobs=rng.random() < 0.5, top_logprobs=2)


@pytest.mark.parametrize("trial", range(3))
def test_mixed_batch_samples_each_row_as_alone(trial):
    """Rows with and without penalties, greedy and seeded, in persistent slots over several steps:
    the same tokens and logprobs as each row in a state of its own."""
    rng = random.Random()
    vocab, n = 300, 8
    params = [_random_row(rng, vocab) for _ in range(n)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 20))] for _ in range(n)]
    steps = [torch.randn(n, vocab) * 3 for _ in range(6)]
    sampler = Sampler()

    def generate(rows: list[int]) -> dict[int, list]:
        state = SamplingState(len(rows), vocab)
        slots = {i: state.add_row(params[i], prompts[i], [], torch.Generator().manual_seed(params[i].seed)
                                  if params[i].seed is not None else None) for i in rows}
        out: dict[int, list] = {i: [] for i in rows}
        for logits in steps:
            batch = state.batch([slots[i] for i in rows], [len(out[i]) for i in rows])
            pending = sampler.sample(logits[rows], batch)
            state.record_sampled(batch, pending.token_ids)
            result = pending.result()
            for j, i in enumerate(rows):
                out[i].append((result.token_ids[j], result.logprobs[j], result.top_logprobs[j]))
        return out

    together = generate(list(range(n)))
    for i in range(n):
        assert generate([i])[i] == together[i], params[i]


def test_penalties_never_wait_for_the_step_in_flight(loaded):
    """Async scheduling with penalty and min_tokens rows: no step's sampling waits for the step
    before it, the tokens equal the synchronous engine's, and the device history equals each
    sequence's output counts."""
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.4),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=8, frequency_penalty=0.9, presence_penalty=0.5,
                             min_tokens=6, logit_bias={13: 2.0})]
    prompts = PROMPTS[:3]
    reference = run(make_engine(loaded), prompts, params)
    engine = make_engine(loaded, async_scheduling=True)
    for i, text in enumerate(prompts):
        engine.add_request(engine.input_processor.process(f"r{i}", text, params[i]))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    state, rows = engine.model_runner.sampling_state, engine.model_runner.sampling_rows
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        for seq in engine.scheduler.running:
            if seq.params.frequency_penalty:  # the device history is at least as new as the host's
                [slot] = rows.slots([seq])
                on_device = state.counts[slot]
                host = Counter(seq.output_token_ids)
                assert all(on_device[t].item() >= c for t, c in host.items())
                assert on_device.sum().item() == len(seq.output_token_ids) + seq.num_pending_tokens
    assert engine.model_runner.num_sampling_waits == 0
    assert tokens == {rid: r["tokens"][0] for rid, r in reference.items()}
    assert_all_blocks_free(engine)


def test_only_structured_output_waits_and_slots_are_freed(loaded):
    engine = make_engine(loaded, async_scheduling=True)
    runner = engine.model_runner
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, presence_penalty=1.0)
    run(engine, PROMPTS[:2], free)
    assert runner.num_sampling_waits == 0
    # The rows of finished sequences are freed at the next step and their slots reused.
    formatted = SamplingParams(temperature=0.0, max_tokens=20, structured_output=StructuredOutputSpec("json_object"))
    run(engine, PROMPTS[2:4], [free, formatted])
    assert runner.num_sampling_waits > 0
    engine.add_request(engine.input_processor.process("last", PROMPTS[5], free))
    engine.step()
    # Only slots 0 and 1 were ever taken (a never-used slot would be 2).
    assert runner.sampling_rows.slots(engine.requests["last"].seqs)[0] in (0, 1)
    assert runner.sampling_state.num_free_slots == runner.sampling_state.max_num_rows - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stream waits are a GPU matter")
def test_adding_a_row_never_waits_for_the_stream():
    """A row is added right after the step's forward is launched: a synchronizing copy there would hold
    the host until that forward ends (a 4k prefill: ~75 ms) instead of preparing the next step."""
    state = SamplingState(4, 64, device="cuda")
    params = SamplingParams(**{**PENALIZED, "allowed_token_ids": [1, 2, 3, 5, 9]})
    state.add_row(params, [1, 2, 2], [3, 3, 8], None, eos_token_ids=[11])  # allocates the [R, V] planes
    torch.cuda.set_sync_debug_mode("error")
    try:
        slot = state.add_row(params, [4, 6], [7], None, eos_token_ids=[11])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert state.top_k[slot].item() == 7 and state.seen[slot].nonzero().flatten().tolist() == [4, 6]
    assert state.allowed[slot].nonzero().flatten().tolist() == [1, 2, 3, 5, 9]
