"""One completion's tokens and scheduling state."""

from __future__ import annotations

import enum
import itertools
from typing import Any
from dataclasses import dataclass, field

import torch

from inference_service.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Finish:
    """A stop check's verdict: why a sequence ends. Only `Scheduler.finish` records it on the sequence."""

    reason: FinishReason
    stop_reason: str | int | None = None  # the stop string or stop token id, when one ended it


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """The tokens of one completion (prompt + output) and where its KV cache lives.

    `num_computed_tokens` counts tokens whose K/V are in the cache or being written by a
    scheduled step. A sequence is caught up when every token but the newest sampled one is
    computed; a step that computes its last token samples the next one. A sampled token is
    pending from the step's scheduling until its id reaches the host (with async scheduling, the
    next step is scheduled before that, and computes the pending token from the id on the GPU)::

        token_ids:  [ prompt ............ | output ...... ] + num_pending_tokens
                    [ computed (KV in cache) ....... | to compute ]
                                                     ^ num_computed_tokens
    """

    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output may not exceed this (context window / max_tokens)
    generator: torch.Generator | None = None
    grammar: Any = None  # llguidance matcher of a structured-output request, fed every sampled token
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority scheduling policy
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # sampled by a scheduled step, id not yet appended to token_ids
    # With `params.prompt_logprobs` (completion 0 only): entry i is prompt token i + 1's logprob, from the
    # logits at position i. None: not collected.
    prompt_logprobs: list | None = None
    # Prompt positions whose logprobs a launched step computes (they arrive with its outputs). It never
    # goes back: a preempted sequence's recompute skips them, so none is duplicated or lost.
    num_prompt_logprobs_scheduled: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def is_collecting_prompt_logprobs(self) -> bool:
        """Some prompt position's logprobs are still to be computed (and so may not come from the prefix cache)."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs_scheduled < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.consume_token(token_id)

    def check_stop(self) -> Finish | None:
        """The token-level stop rules applied to the newest token: the verdict, or None to go on."""
        last = self.token_ids[-1]
        params = self.params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return Finish(FinishReason.STOP)
            if last in params.stop_token_ids:
                return Finish(FinishReason.STOP, last)
        if self.grammar is not None and self.grammar.is_stopped():
            # The format is complete and admits nothing more (EOS included, under ignore_eos).
            return Finish(FinishReason.STOP)
        if len(self.token_ids) >= self.max_total_tokens:
            return Finish(FinishReason.LENGTH)
        return None
