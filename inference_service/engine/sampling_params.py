"""Per-request sampling and stopping parameters, validated on construction.

Semantics and defaults follow `SamplingParams` and `StoppingCriteria` in
`proto/inference/v1/inference.proto`; every error names the proto field path it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from inference_service.engine.structured_output import StructuredOutputSpec
from inference_service.errors import InvalidRequestError

# Temperatures below this are treated as greedy: dividing logits by it would overflow anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_SEED = 2**64 - 1  # the proto's seed is a uint64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(value: object, field_path: str, *, low: float, high: float,
                  low_open: bool = False, high_open: bool = False) -> None:
    """Raises unless `value` is a finite number in the given interval."""
    ok = _is_number(value) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        if math.isinf(high):
            want = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            lo, hi = "(" if low_open else "[", ")" if high_open else "]"
            want = f"a number in {lo}{low:g}, {high:g}{hi}"
        raise InvalidRequestError(f"{field_path} must be {want}, got {value!r}", field=field_path)


def _check_int(value: object, field_path: str, *, low: int, high: int | None = None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequestError(f"{field_path} must be an integer {bound}, got {value!r}", field=field_path)


def _check_bool(value: object, field_path: str) -> None:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{field_path} must be a boolean, got {value!r}", field=field_path)


def _check_token_list(value: object, field_path: str) -> None:
    if not isinstance(value, list):
        raise InvalidRequestError(f"{field_path} must be a list of token ids, got {value!r}", field=field_path)
    for i, token_id in enumerate(value):
        _check_int(token_id, f"{field_path}[{i}]", low=0)


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when its generation stops.

    Raises `InvalidRequestError` (with `field` set to the proto path, such as
    `sampling.top_p`) from the constructor when a value is out of range. Checks that need
    the model are in `validate_for_model`.
    """

    # --- sampling.* ---
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position; only used with `logprobs`
    structured_output: StructuredOutputSpec | None = None  # None: free text
    allowed_token_ids: list[int] = field(default_factory=list)  # empty: any token
    bad_words: list[str] = field(default_factory=list)
    prompt_logprobs: int | None = None  # alternatives per prompt position; None: no prompt logprobs
    # --- stopping.* ---
    max_tokens: int | None = None  # None: `default_max_tokens`, else up to the end of the context window
    # The server's default (`--default-max-tokens`, generation_config's max_new_tokens) for a request that
    # sets no max_tokens; unlike max_tokens it is cut to the context left after the prompt, never refused.
    default_max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # --- request level ---
    n: int = 1
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last this many tokens
    # Token sequences of `bad_words` (each word with and without a leading space), filled in by the
    # InputProcessor, which has the tokenizer (`set_bad_words_token_ids`).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        inf = math.inf
        _check_number(self.temperature, "sampling.temperature", low=0.0, high=inf)
        _check_number(self.top_p, "sampling.top_p", low=0.0, high=1.0, low_open=True)
        _check_int(self.top_k, "sampling.top_k", low=0)
        _check_number(self.min_p, "sampling.min_p", low=0.0, high=1.0)
        _check_number(self.repetition_penalty, "sampling.repetition_penalty", low=0.0, high=inf, low_open=True)
        _check_number(self.frequency_penalty, "sampling.frequency_penalty", low=-2.0, high=2.0)
        _check_number(self.presence_penalty, "sampling.presence_penalty", low=-2.0, high=2.0)
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError(
                f"sampling.logit_bias must be a map of token id to bias, got {self.logit_bias!r}",
                field="sampling.logit_bias",
            )
        for token_id, bias in self.logit_bias.items():
            path = f"sampling.logit_bias[{token_id}]"
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequestError(
                    f"sampling.logit_bias keys must be token ids >= 0, got {token_id!r}", field=path
                )
            _check_number(bias, path, low=-100.0, high=100.0)
        if self.seed is not None:
            _check_int(self.seed, "sampling.seed", low=0, high=MAX_SEED)
        _check_bool(self.logprobs, "sampling.logprobs")
        _check_int(self.top_logprobs, "sampling.top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutputSpec):
            raise InvalidRequestError(f"sampling.structured_output must be a StructuredOutputSpec, got "
                                      f"{self.structured_output!r}", field="sampling.structured_output")

        _check_token_list(self.allowed_token_ids, "sampling.allowed_token_ids")
        if not isinstance(self.bad_words, list):
            raise InvalidRequestError(f"sampling.bad_words must be a list of strings, got {self.bad_words!r}",
                                      field="sampling.bad_words")
        for i, word in enumerate(self.bad_words):
            if not isinstance(word, str) or not word.strip():
                raise InvalidRequestError(f"sampling.bad_words[{i}] must be a non-empty string, got {word!r}",
                                          field=f"sampling.bad_words[{i}]")
        if self.prompt_logprobs is not None:
            _check_int(self.prompt_logprobs, "sampling.prompt_logprobs", low=0, high=MAX_TOP_LOGPROBS)

        if self.max_tokens is not None:
            _check_int(self.max_tokens, "stopping.max_tokens", low=1)
        if self.default_max_tokens is not None:
            _check_int(self.default_max_tokens, "stopping.max_tokens", low=1)
        _check_int(self.min_tokens, "stopping.min_tokens", low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"stopping.min_tokens ({self.min_tokens}) must not exceed stopping.max_tokens "
                f"({self.max_tokens})",
                field="stopping.min_tokens",
            )
        if not isinstance(self.stop, list):
            raise InvalidRequestError(f"stopping.stop must be a list of strings, got {self.stop!r}",
                                      field="stopping.stop")
        for i, text in enumerate(self.stop):
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(
                    f"stopping.stop[{i}] must be a non-empty string, got {text!r}", field=f"stopping.stop[{i}]"
                )
        if not isinstance(self.stop_token_ids, list):
            raise InvalidRequestError(
                f"stopping.stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}",
                field="stopping.stop_token_ids",
            )
        for i, token_id in enumerate(self.stop_token_ids):
            _check_int(token_id, f"stopping.stop_token_ids[{i}]", low=0)
        _check_bool(self.ignore_eos, "stopping.ignore_eos")
        _check_bool(self.include_stop_str_in_output, "stopping.include_stop_str_in_output")

        _check_int(self.n, "n", low=1, high=MAX_N)
        _check_bool(self.skip_special_tokens, "skip_special_tokens")
        if self.truncate_prompt_tokens is not None:
            _check_int(self.truncate_prompt_tokens, "truncate_prompt_tokens", low=1)

    @property
    def has_multi_token_bad_words(self) -> bool:
        """Whether a bad word's ban depends on the output so far (its token sequence is longer than one)."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids)

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is always the (processed) argmax: temperature ~0 or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate_for_model(self, vocab_size: int, max_model_len: int | None = None,
                           num_prompt_tokens: int | None = None) -> None:
        """Checks what depends on the served model: token ids must be below `vocab_size`, and
        when `max_model_len` and `num_prompt_tokens` are given, prompt + max_tokens must fit.
        Raises `InvalidRequestError` naming the field."""
        for token_id in self.logit_bias:
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"sampling.logit_bias token id {token_id} is out of range for a vocabulary of "
                    f"{vocab_size} tokens",
                    field=f"sampling.logit_bias[{token_id}]",
                )
        for i, token_id in enumerate(self.allowed_token_ids):
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"sampling.allowed_token_ids[{i}] = {token_id} is out of range for a vocabulary of "
                    f"{vocab_size} tokens",
                    field=f"sampling.allowed_token_ids[{i}]",
                )
        for i, token_id in enumerate(self.stop_token_ids):
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"stopping.stop_token_ids[{i}] = {token_id} is out of range for a vocabulary of "
                    f"{vocab_size} tokens",
                    field=f"stopping.stop_token_ids[{i}]",
                )
        if max_model_len is not None and num_prompt_tokens is not None and self.max_tokens is not None:
            if num_prompt_tokens + self.max_tokens > max_model_len:
                raise InvalidRequestError(
                    f"stopping.max_tokens ({self.max_tokens}) plus the prompt's {num_prompt_tokens} tokens "
                    f"exceeds the model's context length of {max_model_len} tokens",
                    field="stopping.max_tokens",
                )
