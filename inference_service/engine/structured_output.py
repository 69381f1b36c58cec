"""Structured output: token masks that keep a request's output inside a format.

A format (`StructuredOutputSpec`: a JSON schema, any JSON object, a regular expression or a Lark
grammar) is compiled by llguidance into a matcher per sequence. Each step, before sampling, the
matcher gives the set of tokens that keep the output a prefix of a match (EOS only once it is a
whole match); the sampler sets every other logit to -inf. The sampled token is then fed back
(`Sequence.append_token`). Masks are computed on the host from the newest token, so the sampling
of a step holding a constrained sequence waits for the step before it; its forward does not
(`ForwardStep.waits_for_previous_step` in model_runner.py).

llguidance is imported only when the first constrained request arrives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from inference_service.errors import InvalidRequestError, UnimplementedError

if TYPE_CHECKING:
    from inference_service.model.tokenizer import Tokenizer

FIELD = "sampling.structured_output"
KINDS = ("json_schema", "json_object", "regex", "lark_grammar")
_BITS = torch.arange(32, dtype=torch.int32)  # [32]


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """One request's format: `kind` in KINDS and its text (unused for json_object)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"{FIELD} must be one of {', '.join(KINDS)}, got {self.kind!r}", field=FIELD)
        path = f"{FIELD}.{self.kind}"
        if not isinstance(self.value, str) or (self.kind != "json_object" and not self.value):
            raise InvalidRequestError(f"{path} must be a non-empty string", field=path)
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{path} is not valid JSON: {exc}", field=path) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(f"{path} must be a JSON schema object, got {type(schema).__name__}",
                                          field=path)

    def grammar(self) -> str:
        """The format as an llguidance grammar (not yet checked)."""
        from llguidance import LLMatcher  # noqa: PLC0415 - only for constrained requests

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.value)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        return LLMatcher.grammar_from_lark(self.value)


class GrammarCompiler:
    """Compiles formats into matchers over one model's tokenizer.

    The llguidance tokenizer (every token's bytes, ~0.2 s for a 49k vocabulary) is built on first use.
    `vocab_size` is the model's logits width, which may exceed the tokenizer's vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer: Any = None

    def _llg_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            from llguidance import LLTokenizer  # noqa: PLC0415

            try:
                self._ll_tokenizer = LLTokenizer(self._tokenizer.backend_json(), n_vocab=self.vocab_size,
                                                 eos_token=list(self._tokenizer.eos_token_ids))
            except Exception as exc:  # noqa: BLE001 - a tokenizer llguidance cannot read: no formats here
                raise UnimplementedError(f"structured output is not available for this model's tokenizer: {exc}"
                                         ) from None
        return self._ll_tokenizer

    def compile(self, spec: StructuredOutputSpec) -> Any:
        """A fresh matcher (llguidance `LLMatcher`) for `spec`; raises `InvalidRequestError` naming
        the field when the format does not compile."""
        from llguidance import LLMatcher  # noqa: PLC0415

        path = f"{FIELD}.{spec.kind}"
        try:
            grammar = spec.grammar()
        except ValueError as exc:
            raise InvalidRequestError(f"{path} is invalid: {exc}", field=path) from None
        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            # llguidance's message quotes the format and points at the offending place.
            raise InvalidRequestError(f"{path} is invalid: {matcher.get_error().strip()}", field=path)
        return matcher


def token_bitmask(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """The tokens each matcher allows next, one bit a token: int32 [len(matchers), ceil(vocab_size / 32)] on
    the CPU (bit j of word w is token 32 w + j), 32x smaller to copy to the device than a bool mask."""
    num_words = (vocab_size + 31) // 32
    bitmask = torch.empty(len(matchers), num_words, dtype=torch.int32)  # [R, W]
    for row, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), num_words * 4)
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, W] bitmask -> bool [R, vocab_size], on the bitmask's device."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1  # [R, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
