"""Sampler against plain-Python reference code, with fresh random inputs each run."""

from __future__ import annotations

import math
import random
from collections import Counter
from unittest import mock

import pytest
import torch

from inference_service.cpu_kernels.build import load_extension
from inference_service.engine.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties_and_masks,
    apply_top_k_top_p_min_p,
    argmax_rows,
    make_generator,
)
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.sampling_state import SamplingState

NEG_INF = float("-inf")


# ---------------------------------------------------------------- reference code (plain Python)
def ref_process(row: list[float], p: SamplingParams, prompt: list[int], output: list[int], eos: set[int]):
    x = list(row)
    for t, b in p.logit_bias.items():
        x[t] += b
    if len(output) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else eos)
        for t in banned:
            x[t] = NEG_INF
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def ref_softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) if v != NEG_INF else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]


def ref_allowed(x: list[float], p: SamplingParams, margin: float = 1e-4) -> set[int] | None:
    """Tokens that temperature, top-k, top-p and min-p leave possible; None if a float boundary
    is too close to call."""
    x = [v / p.temperature for v in x]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = order[: p.top_k] if p.top_k > 0 else order
    probs = ref_softmax([x[i] for i in keep])
    if p.top_p < 1.0:
        kept, before = [], 0.0
        for i, pr in zip(keep, probs):
            if abs(before - p.top_p) < margin:
                return None
            if kept and before >= p.top_p:
                break
            kept.append(i)
            before += pr
        keep = kept
    probs = ref_softmax([x[i] for i in keep])
    if p.min_p > 0.0:
        threshold = p.min_p * max(probs)
        if any(abs(pr - threshold) < margin * threshold for pr in probs):
            return None
        keep = [i for i, pr in zip(keep, probs) if pr >= threshold]
    return set(keep)


def random_params(rng: random.Random, vocab: int, **overrides) -> SamplingParams:
    kw = dict(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 1, 3, 17]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.7, -0.5]),
        presence_penalty=rng.choice([0.0, 1.1, -2.0]),
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.choice([0, 0, 1, 4]))},
        min_tokens=rng.choice([0, 0, 3, 10]),
        stop_token_ids=rng.sample(range(vocab), rng.choice([0, 2])),
        ignore_eos=rng.random() < 0.3,
        logprobs=rng.random() < 0.5,
        top_logprobs=rng.choice([0, 1, 5, 20]),
    )
    kw.update(overrides)
    return SamplingParams(**kw)


def random_case(rng: random.Random, num_rows: int, vocab: int, **overrides):
    params = [random_params(rng, vocab, **overrides) for _ in range(num_rows)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(num_rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 15))] for _ in range(num_rows)]
    logits = torch.randn(num_rows, vocab) * 3
    return params, prompts, outputs, logits


def make_batch(params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]],
               generators: list, vocab: int, eos_token_ids=()) -> SamplingBatch:
    """Row i (params, prompt, output so far, generator) written into a fresh `SamplingState`, then
    gathered as one step's batch. `eos_token_ids`: one collection of ids for all rows, or one per row."""
    n = len(params)
    if eos_token_ids and all(isinstance(t, int) for t in eos_token_ids):
        eos_per_row = [eos_token_ids] * n
    else:
        eos_per_row = list(eos_token_ids) or [()] * n
    state = SamplingState(n, vocab)
    slots = [state.add_row(*row) for row in zip(params, prompts, outputs, generators, eos_per_row)]
    return state.batch(slots, [len(out) for out in outputs])


# ---------------------------------------------------------------- processing and greedy
@pytest.mark.parametrize("trial", range(5))
def test_penalties_and_masks_match_reference(trial):
    rng = random.Random()
    vocab, n = rng.choice([(50, 9), (301, 16)])
    params, prompts, outputs, logits = random_case(rng, n, vocab)
    eos = [set(rng.sample(range(vocab), rng.choice([1, 2]))) for _ in range(n)]
    batch = make_batch(params, prompts, outputs, [None] * n, vocab, eos_token_ids=eos)
    got = apply_penalties_and_masks(logits.clone(), batch).tolist()
    for i in range(n):
        want = ref_process(logits[i].tolist(), params[i], prompts[i], outputs[i], eos[i])
        for g, w in zip(got[i], want):
            assert (g == w == NEG_INF) or math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-4), (i, g, w)


def test_shared_eos_ids_and_min_tokens():
    vocab = 10
    logits = torch.zeros(3, vocab)
    logits[:, 7] = 50.0  # EOS would win
    logits[:, 4] = 40.0  # the stop token would win next
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4], ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=2)]
    outputs = [[1], [1], [1, 2]]  # rows 0 and 1 are short of min_tokens, row 2 is not
    batch = make_batch(params, [[]] * 3, outputs, [None] * 3, vocab, eos_token_ids=frozenset({7}))
    assert Sampler()(logits, batch).token_ids == [0, 7, 7]


@pytest.mark.parametrize("trial", range(3))
def test_greedy_is_argmax_of_processed_logits(trial):
    rng = random.Random()
    vocab, n = 257, 12
    params, prompts, outputs, logits = random_case(rng, n, vocab, temperature=0.0)
    eos = {rng.randrange(vocab)}
    batch = make_batch(params, prompts, outputs, [None] * n, vocab, eos_token_ids=eos)
    before = logits.clone()
    out = Sampler()(logits, batch)
    assert torch.equal(logits, before)  # the input is never modified
    for i in range(n):
        want = ref_process(logits[i].tolist(), params[i], prompts[i], outputs[i], eos)
        assert out.token_ids[i] == max(range(vocab), key=lambda t: want[t])


def test_all_greedy_fast_path():
    n, vocab = 6, 1000
    logits = torch.randn(n, vocab)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1)] * 3
    batch = make_batch(params, [[1, 2]] * n, [[3]] * n, [None] * n, vocab)
    assert batch.all_greedy and not batch.needs_processing and batch.selection is None
    assert batch.processors == [] and batch.history is None and not batch.logprob_rows
    out = Sampler()(logits, batch)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * n and out.top_logprobs == [None] * n


@pytest.fixture(params=["torch", "avx512", "generic"])
def argmax_path(request):
    """Which argmax `argmax_rows` runs on the CPU: torch's chunked one (no extension), or the CPU kernels'
    with their AVX-512 path or their generic one (the AVX2 cap)."""
    ext = load_extension()
    if request.param == "torch":
        with mock.patch("inference_service.engine.sampler.cpu_ops_for", return_value=None):
            yield request.param
        return
    if ext is None:
        pytest.skip("the CPU kernels extension is not built here")
    if request.param == "avx512" and ext.limit_instruction_set("avx512") != "avx512":
        ext.limit_instruction_set("amx")
        pytest.skip("this CPU has no AVX-512")
    if request.param == "generic":
        ext.limit_instruction_set("avx2")
    try:
        yield request.param
    finally:
        ext.limit_instruction_set("amx")  # no cap: the best path this CPU has


@pytest.mark.parametrize("vocab", [256, 49152, 1000, 7])
def test_argmax_rows_picks_the_first_maximum(vocab, argmax_path):
    n = 9
    x = torch.randn(n, vocab)
    x[1] = 0.5  # a row of ties: index 0
    x[2, [vocab - 1, 3, vocab // 2]] = 100.0  # three equal maxima in different chunks: the first
    x[3, [7 % vocab, 300 % vocab]] = float("inf")
    x[4] = NEG_INF
    x[5, [vocab - 3, 10 % vocab]] = float("nan")  # NaN is the maximum, its first occurrence wins
    x[6] = torch.arange(vocab, dtype=torch.float32)  # maximum in the very last slot
    def first_max(row: list[float]) -> int:
        return max(range(vocab), key=lambda t: (math.isnan(row[t]), 0.0 if math.isnan(row[t]) else row[t], -t))

    expected = [first_max(row) for row in x.tolist()]
    assert argmax_rows(x).tolist() == expected == x.argmax(-1).tolist()


# ---------------------------------------------------------------- top-k / top-p / min-p
@pytest.mark.parametrize("trial", range(6))
def test_top_k_top_p_min_p_masks_match_reference(trial):
    rng = random.Random()
    vocab, n = rng.choice([(40, 24), (500, 12)])
    # top_k=1 would make a row greedy; every row here is sampled.
    params = [random_params(rng, vocab, temperature=rng.choice([0.3, 1.0, 2.0]), top_k=rng.choice([0, 2, 3, 17]))
              for _ in range(n)]
    logits = torch.randn(n, vocab) * 2
    batch = make_batch(params, [[]] * n, [[]] * n, [None] * n, vocab)
    sel = batch.selection
    scaled = logits / sel.temperature
    masked = apply_top_k_top_p_min_p(scaled.clone(), sel.top_k, sel.top_p, sel.min_p)
    checked = 0
    for i in range(n):
        want = ref_allowed(logits[i].tolist(), params[i])
        if want is None:
            continue
        checked += 1
        got = set(torch.nonzero(torch.isfinite(masked[i])).flatten().tolist())
        assert got == want, (params[i], sorted(got ^ want))
        finite = torch.isfinite(masked[i])
        assert torch.allclose(masked[i][finite], scaled[i][finite])  # survivors untouched
    assert checked >= n // 2


def test_top_p_cutoff_deep_in_a_flat_distribution():
    # Flat rows need far more than the first top-p candidates; peaked rows very few.
    vocab = 3000
    logits = torch.randn(4, vocab)
    logits[0] *= 0.05
    logits[1] *= 8.0
    logits[2] *= 0.3
    params = [SamplingParams(top_p=0.95), SamplingParams(top_p=0.7), SamplingParams(top_p=0.5, top_k=2000),
              SamplingParams(top_p=1.0, min_p=0.2)]
    batch = make_batch(params, [[]] * 4, [[]] * 4, [None] * 4, vocab)
    sel = batch.selection
    masked = apply_top_k_top_p_min_p(logits.clone(), sel.top_k, sel.top_p, sel.min_p)
    for i, p in enumerate(params):
        want = ref_allowed(logits[i].tolist(), p)
        if want is not None:
            assert set(torch.nonzero(torch.isfinite(masked[i])).flatten().tolist()) == want
    assert torch.isfinite(masked[0]).sum() > 1000


def test_sampled_tokens_stay_in_allowed_set():
    rng = random.Random()
    vocab, n = 64, 300
    base = torch.randn(vocab) * 2
    params = [SamplingParams(temperature=1.3, top_k=rng.choice([0, 5, 9]), top_p=rng.choice([1.0, 0.6]),
                             min_p=rng.choice([0.0, 0.1])) for _ in range(n)]
    out = Sampler()(base.expand(n, vocab).contiguous(), make_batch(params, [[]] * n, [[]] * n, [None] * n, vocab))
    for p, token in zip(params, out.token_ids):
        allowed = ref_allowed(base.tolist(), p)
        assert allowed is None or token in allowed


# ---------------------------------------------------------------- logprobs
@pytest.mark.parametrize("trial", range(3))
def test_logprobs_are_raw_log_softmax(trial):
    rng = random.Random()
    vocab, n = 300, 10
    params, prompts, outputs, logits = random_case(rng, n, vocab)
    batch = make_batch(params, prompts, outputs, [None] * n, vocab, eos_token_ids=[0])
    out = Sampler()(logits, batch)
    for i, p in enumerate(params):
        if not p.logprobs:
            assert out.logprobs[i] is None and out.top_logprobs[i] is None
            continue
        row = logits[i].tolist()
        m = max(row)
        lse = m + math.log(sum(math.exp(v - m) for v in row))
        ref = [v - lse for v in row]
        assert math.isclose(out.logprobs[i], ref[out.token_ids[i]], abs_tol=1e-4)
        top = out.top_logprobs[i]
        want = sorted(range(vocab), key=lambda t: -ref[t])[: p.top_logprobs]
        assert [t for t, _ in top] == want
        for t, v in top:
            assert math.isclose(v, ref[t], abs_tol=1e-4)


# ---------------------------------------------------------------- seeds
def _run_seeded(target: SamplingParams, position: int, batch_size: int, logit_steps: list[torch.Tensor],
                rng: random.Random) -> list[int]:
    """Samples the target row for every step, at `position` in a batch of random other rows."""
    vocab = logit_steps[0].shape[0]
    target_gen = make_generator(target.seed)
    others = [random_params(rng, vocab, seed=rng.choice([None, 7, 99])) for _ in range(batch_size - 1)]
    other_gens = [make_generator(p.seed) for p in others]
    tokens: list[int] = []
    for step_logits in logit_steps:
        params, gens = list(others), list(other_gens)
        params.insert(position, target)
        gens.insert(position, target_gen)
        logits = torch.randn(batch_size, vocab) * 2
        logits[position] = step_logits
        outputs = [[rng.randrange(vocab) for _ in range(3)] for _ in range(batch_size)]
        outputs[position] = list(tokens)
        batch = make_batch(params, [[1, 2, 3]] * batch_size, outputs, gens, vocab, eos_token_ids=[0])
        tokens.append(Sampler()(logits, batch).token_ids[position])
    return tokens


@pytest.mark.parametrize("target_kw", [
    {"temperature": 1.0},
    {"temperature": 0.8, "top_p": 0.95, "frequency_penalty": 0.3},
    {"temperature": 1.2, "top_k": 50, "min_p": 0.01},
])
def test_same_seed_same_tokens_whatever_the_batch(target_kw):
    rng = random.Random()
    vocab = 1000
    seed = rng.randrange(2**63)
    steps = [torch.randn(vocab) for _ in range(20)]
    target = SamplingParams(seed=seed, **target_kw)
    alone = _run_seeded(target, 0, 1, steps, rng)
    for position in (0, 3, 7):
        assert _run_seeded(target, position, 8, steps, rng) == alone
    other = SamplingParams(**{**target_kw, "seed": seed + 1})
    assert _run_seeded(other, 5, 8, steps, rng) != alone


# ---------------------------------------------------------------- statistics
def test_top_k_2_only_ever_yields_the_two_best():
    vocab, n = 50, 4000
    base = torch.randn(vocab)
    best2 = set(base.topk(2).indices.tolist())
    params = [SamplingParams(top_k=2, temperature=1.5)] * n
    out = Sampler()(base.expand(n, vocab).contiguous(), make_batch(params, [[]] * n, [[]] * n, [None] * n, vocab))
    assert set(out.token_ids) == best2


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_frequencies_match_softmax(temperature):
    vocab, n = 6, 40000
    base = torch.randn(vocab)
    params = [SamplingParams(temperature=temperature)] * n
    batch = make_batch(params, [[]] * n, [[]] * n, [None] * n, vocab)
    counts = Counter(Sampler()(base.expand(n, vocab).contiguous(), batch).token_ids)
    probs = ref_softmax([v / temperature for v in base.tolist()])
    for t in range(vocab):
        sigma = math.sqrt(n * probs[t] * (1 - probs[t]))
        assert abs(counts[t] - n * probs[t]) <= 5 * sigma + 1, (t, counts[t], n * probs[t])


def test_seeded_generator_frequencies_match_softmax():
    # One seeded generator drawn from many times follows the distribution too.
    vocab, steps = 4, 4000
    base = torch.tensor([2.0, 1.0, 0.5, -1.0])
    gen = make_generator(random.randrange(2**32))
    p = [SamplingParams(seed=1)]
    counts = Counter(Sampler()(base[None], make_batch(p, [[]], [[]], [gen], vocab)).token_ids[0]
                     for _ in range(steps))
    probs = ref_softmax(base.tolist())
    for t in range(vocab):
        sigma = math.sqrt(steps * probs[t] * (1 - probs[t]))
        assert abs(counts[t] - steps * probs[t]) <= 5 * sigma + 1
