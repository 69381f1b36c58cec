"""Turns sampled tokens into text deltas: incremental detokenization, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

from inference_service.engine.detokenizer import IncrementalDetokenizer
from inference_service.engine.model_runner import SampledToken
from inference_service.engine.request import CompletionDelta, TokenLogprob
from inference_service.engine.sequence import Finish, FinishReason, Sequence
from inference_service.engine.stop_checker import StopStringMatcher
from inference_service.model.tokenizer import Tokenizer


@dataclass
class _SeqOutput:
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher


class OutputProcessor:
    """Keeps each running sequence's detokenizer and stop-string matcher."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[int, _SeqOutput] = {}

    def add(self, seq: Sequence) -> None:
        self._states[seq.seq_id] = _SeqOutput(
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens),
            StopStringMatcher(seq.params.stop, seq.params.include_stop_str_in_output),
        )

    def remove(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    def process(self, seq: Sequence, sampled: SampledToken) -> tuple[CompletionDelta, Finish | None]:
        """Makes the delta for the token just appended to `seq`.

        Returns the delta and the stop-string verdict, if a stop string ends the sequence (the caller
        has the scheduler record it). Never writes the sequence's finish state."""
        state = self._states[seq.seq_id]
        token_id = seq.token_ids[-1]
        text, matched_stop = state.stop_matcher.feed(state.detokenizer.append(token_id))
        if matched_stop is None and seq.is_finished:
            # Release what was held back: a trailing partial character, a possible stop-string start.
            tail, matched_stop = state.stop_matcher.feed(state.detokenizer.flush())
            text += tail if matched_stop is not None else tail + state.stop_matcher.flush()
        verdict = Finish(FinishReason.STOP, matched_stop) if matched_stop is not None else None
        finish = verdict or (Finish(seq.finish_reason, seq.stop_reason) if seq.is_finished else None)
        logprobs = None
        if sampled.logprob is not None:
            logprobs = [TokenLogprob(token_id, sampled.logprob, sampled.top_logprobs or [])]
        delta = CompletionDelta(
            request_id=seq.request_id,
            index=seq.index,
            token_ids=[token_id],
            text=text,
            logprobs=logprobs,
            finish_reason=finish.reason if finish is not None else None,
            stop_reason=finish.stop_reason if finish is not None else None,
        )
        if finish is not None:
            self.remove(seq)
        return delta, verdict
