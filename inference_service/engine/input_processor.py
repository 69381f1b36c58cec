"""Turns client input (text, token ids or chat messages) into a validated `EngineRequest`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inference_service.engine.request import EngineRequest
from inference_service.engine.sampling_params import SamplingParams
from inference_service.errors import InvalidRequestError
from inference_service.model.tokenizer import Tokenizer

# Variables the engine itself hands the chat template; `chat_template_kwargs` may not set them (each has
# its own request field, or none). The proxy refuses the same names (`rest_proxy/protocol.py`).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "special_tokens"})
# NOTE: normalizers (NFC) may shrink text before it is split into tokens; a factor of 4 on the longest
# token keeps the length bound below safe for any of them.
_NORMALIZATION_SLACK = 4


@dataclass
class ChatPrompt:
    """Chat messages (OpenAI-shaped dicts) and tools to render with the model's chat template."""

    messages: list[dict[str, Any]]
    tools_json: str = ""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs_json: str = ""


class InputProcessor:
    """Tokenizes and validates requests against the model's limits."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # No prompt of more UTF-8 bytes than this fits: each token stands for at most this many bytes / token.
        self.max_bytes_per_token = _NORMALIZATION_SLACK * longest_token_bytes(tokenizer, vocab_size)
        self.max_prompt_bytes = (max_model_len - 1) * self.max_bytes_per_token

    def render_chat(self, chat: ChatPrompt) -> str:
        if not chat.messages:
            raise InvalidRequestError("chat.messages must not be empty", field="chat.messages")
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("the model has no chat template; send text or token ids", field="chat")
        tools = _parse_json(chat.tools_json, "chat.tools_json", list)
        kwargs = _parse_json(chat.template_kwargs_json, "chat.chat_template_kwargs_json", dict) or {}
        reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: the engine passes "
                f"{'it' if len(reserved) == 1 else 'them'} to the template itself", field="chat.chat_template_kwargs_json")
        if chat.continue_final_message and chat.add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true", field="chat.continue_final_message"
            )
        return self.tokenizer.apply_chat_template(
            chat.messages,
            tools=tools or None,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            **kwargs,
        )

    def tokenize_prompt(self, prompt: str | list[int] | ChatPrompt, add_special_tokens: bool | None,
                        truncate_prompt_tokens: int | None = None) -> list[int]:
        """The prompt's token ids (only the last `truncate_prompt_tokens` of them when set). A prompt too
        long for the context is refused before it is tokenized (tokenizing megabytes takes seconds) by its
        length in bytes: see `max_bytes_per_token`; a truncated one is not (the message size bounds it)."""
        check = truncate_prompt_tokens is None
        if isinstance(prompt, ChatPrompt):
            text = self.render_chat(prompt)
            if check:
                self._check_length(text, "chat.messages")
            # The template already holds every special token the model expects.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return ids if check else ids[-truncate_prompt_tokens:]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", field="text")
            if check:
                self._check_length(prompt, "text")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            return ids if check else ids[-truncate_prompt_tokens:]
        if not check:
            prompt = prompt[-truncate_prompt_tokens:]
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens, but the model's context length is {self.max_model_len} "
                f"and at least one token must be generated", field="input")
        prompt = list(prompt)
        # min/max run in C: a per-id loop costs ~0.1 ms per 1k ids on the first token's path.
        if prompt and (min(prompt) < 0 or max(prompt) >= self.vocab_size):
            i, token_id = next((i, t) for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size)
            raise InvalidRequestError(
                f"token_ids[{i}] = {token_id} is outside the vocabulary (size {self.vocab_size})", field="token_ids")
        return prompt

    def process(
        self,
        request_id: str,
        prompt: str | list[int] | ChatPrompt,
        params: SamplingParams,
        add_special_tokens: bool | None = None,
        priority: int = 0,
    ) -> EngineRequest:
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2**31 <= priority < 2**31:
            raise InvalidRequestError(f"priority must be a 32-bit integer, got {priority!r}", field="priority")
        prompt_ids = self.tokenize_prompt(prompt, add_special_tokens, params.truncate_prompt_tokens)
        num_prompt = len(prompt_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty (0 tokens)", field="input")
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens, but the model's context length is {self.max_model_len} "
                f"and at least one token must be generated",
                field="input",
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens = {params.max_tokens} plus the prompt's {num_prompt} tokens exceeds the model's "
                f"context length of {self.max_model_len}",
                field="stopping.max_tokens",
            )
        params.validate_for_model(self.vocab_size)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        return EngineRequest(request_id=request_id, prompt_token_ids=prompt_ids, params=params, priority=priority)


    def _check_length(self, text: str, field: str) -> None:
        # A character is at least one byte: only a text that might fit pays for counting its bytes.
        if len(text) <= self.max_prompt_bytes and len(text.encode("utf-8")) <= self.max_prompt_bytes:
            return
        raise InvalidRequestError(
            f"the prompt is over {self.max_prompt_bytes} bytes of UTF-8, so it is longer than the model's context "
            f"length of {self.max_model_len} tokens (no token of this model stands for more than "
            f"{self.max_bytes_per_token // _NORMALIZATION_SLACK} bytes)", field=field)


def bad_words_token_ids(tokenizer: Tokenizer, bad_words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as vLLM finds them: the word as given (left-stripped), and with a leading
    space where that makes a different first token of as many tokens (the word inside a text)."""
    out: list[list[int]] = []
    for word in bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if bare:
            out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def longest_token_bytes(tokenizer: Tokenizer, vocab_size: int) -> int:
    """The most bytes of text any one token of the vocabulary stands for."""
    longest = 1
    for token_id in range(vocab_size):
        try:
            longest = max(longest, len(tokenizer.token_bytes(token_id)))
        except ValueError:  # an id the model has but the tokenizer does not (padded vocabularies)
            continue
    return longest


def _parse_json(text: str, field_name: str, kind: type) -> Any:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{field_name} is not valid JSON: {e}", field=field_name) from None
    if not isinstance(value, kind):
        raise InvalidRequestError(f"{field_name} must be a JSON {kind.__name__}", field=field_name)
    return value
