"""What to send and when: request specs (random-token or JSONL prompts) and arrival times."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

LENGTH_DISTS = ("fixed", "uniform", "normal", "exponential")


@dataclass(slots=True)
class RequestSpec:
    """One request to send. Exactly one of `prompt_token_ids`, `prompt` or `messages` is set."""

    index: int
    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict)  # extra OpenAI body fields from a JSONL line


@dataclass(slots=True)
class LengthDist:
    """A length distribution: `mean` tokens, spread as a fraction of it (uniform, normal).

    fixed: always `mean`; uniform: in [mean*(1-spread), mean*(1+spread)]; normal: std mean*spread;
    exponential: mean `mean` (a long tail, like chat traffic). Always at least 1.
    """

    mean: int
    dist: str = "fixed"
    spread: float = 0.0

    def __post_init__(self):
        if self.mean < 1:
            raise ValueError(f"length must be >= 1, got {self.mean}")
        if self.dist not in LENGTH_DISTS:
            raise ValueError(f"length distribution must be one of {LENGTH_DISTS}, got {self.dist!r}")
        if not 0.0 <= self.spread <= 1.0:
            raise ValueError(f"spread must be in [0, 1], got {self.spread}")

    def sample(self, rng: np.random.Generator) -> int:
        if self.dist == "fixed":
            n = self.mean
        elif self.dist == "uniform":
            lo, hi = self.mean * (1 - self.spread), self.mean * (1 + self.spread)
            n = rng.integers(math.floor(lo), math.floor(hi) + 1)
        elif self.dist == "normal":
            n = round(rng.normal(self.mean, self.mean * self.spread))
        else:
            n = round(rng.exponential(self.mean))
        return max(1, int(n))


class RandomTokenWorkload:
    """Prompts of random token ids, so prompt lengths are exact whatever the tokenizer.

    Ids come from `token_range` (default 1000..9999), a range of ordinary tokens in any
    vocabulary of 10k+ entries; special tokens (low ids in most vocabularies) are avoided.
    Request i is the same for the same seed whatever order requests are made in.
    """

    def __init__(self, input_len: LengthDist, output_len: LengthDist, *, ignore_eos: bool = False,
                 token_range: tuple[int, int] = (1000, 10000), seed: int = 0):
        self.input_len, self.output_len = input_len, output_len
        self.ignore_eos = ignore_eos
        self.token_range = token_range
        self.seed = seed

    def __call__(self, index: int) -> RequestSpec:
        rng = np.random.default_rng((self.seed, index))
        n_in = self.input_len.sample(rng)
        ids = rng.integers(self.token_range[0], self.token_range[1], size=n_in).tolist()
        return RequestSpec(index, self.output_len.sample(rng), prompt_token_ids=ids, ignore_eos=self.ignore_eos)


class JsonlWorkload:
    """Prompts from a JSONL file, cycled. Each line is an object with one of `prompt` (text),
    `prompt_token_ids` (list of ints) or `messages` (OpenAI chat messages), and optionally
    `max_tokens` (else `default_max_tokens`) and `extra` (more OpenAI body fields)."""

    def __init__(self, path: str, output_len: LengthDist, *, ignore_eos: bool = False, seed: int = 0):
        self.rows: list[dict] = []
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if sum(k in row for k in ("prompt", "prompt_token_ids", "messages")) != 1:
                    raise ValueError(f"{path}:{line_no}: give exactly one of prompt, prompt_token_ids, messages")
                self.rows.append(row)
        if not self.rows:
            raise ValueError(f"{path}: no prompts")
        self.output_len, self.ignore_eos, self.seed = output_len, ignore_eos, seed

    def __call__(self, index: int) -> RequestSpec:
        row = self.rows[index % len(self.rows)]
        max_tokens = row.get("max_tokens") or self.output_len.sample(np.random.default_rng((self.seed, index)))
        return RequestSpec(index, int(max_tokens), prompt_token_ids=row.get("prompt_token_ids"),
                           prompt=row.get("prompt"), messages=row.get("messages"), ignore_eos=self.ignore_eos,
                           extra=row.get("extra") or {})


def arrival_offsets(request_rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Seconds from the start at which successive requests arrive.

    Gaps are gamma-distributed with shape `burstiness` and mean 1/request_rate: burstiness 1 is
    a Poisson process; below 1 is burstier, above 1 more regular. An infinite rate sends all at once.
    """
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    rng = np.random.default_rng(seed)
    t = 0.0
    while True:
        yield t
        if not math.isinf(request_rate):
            t += rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness))
