"""What goes into the engine (a request) and what comes out (per-completion deltas)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.sequence import FinishReason
from inference_service.errors import EngineError


@dataclass
class EngineRequest:
    """A tokenized, validated generation request."""

    request_id: str  # unique inside the engine
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    # The compiled `params.structured_output` (an llguidance matcher), when compiled before `add_request`
    # (the async engine compiles off the step thread); None: `add_request` compiles it.
    grammar: Any = None
    priority: int = 0  # lower runs first under the priority scheduling policy


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # (token_id, logprob), most likely first
    rank: int | None = None  # 1 + the number of tokens more likely than `token_id`; None: not computed


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class CompletionDelta:
    """New output of one completion since its previous delta.

    The request's last delta (after all of its `n` completions finished) carries `usage`.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    error: EngineError | None = None
    # The prompt's logprobs (tokens 1.. of the prompt), on completion 0's first delta when asked for.
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def is_last(self) -> bool:
        return self.usage is not None


@dataclass(slots=True)
class CompletionOutput:
    """One finished completion of an offline `LLMEngine.generate` call: its deltas put together."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # empty unless the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # completion 0, with `prompt_logprobs`
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class RequestOutput:
    """A request's `n` completions (by index) and its usage, from its deltas."""

    request_id: str
    completions: list[CompletionOutput]
    usage: Usage | None = None

    @classmethod
    def empty(cls, request_id: str, n: int) -> RequestOutput:
        return cls(request_id, [CompletionOutput(i) for i in range(n)])

    def add(self, delta: CompletionDelta) -> None:
        completion = self.completions[delta.index]
        completion.token_ids += delta.token_ids
        completion.text += delta.text
        completion.logprobs += delta.logprobs or []
        if delta.prompt_logprobs is not None:
            completion.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
        if delta.usage is not None:
            self.usage = delta.usage
