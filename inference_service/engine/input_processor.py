"""Turns client input (text, token ids or chat messages) into a validated `EngineRequest`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from inference_service.engine.request import EngineRequest
from inference_service.engine.sampling_params import SamplingParams
from inference_service.errors import InvalidRequestError
from inference_service.model.tokenizer import Tokenizer


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

    def render_chat(self, chat: ChatPrompt) -> str:
        if not chat.messages:
            raise InvalidRequestError("chat.messages must not be empty", field="chat.messages")
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("the model has no chat template; send text or token ids", field="chat")
        tools = _parse_json(chat.tools_json, "chat.tools_json", list)
        kwargs = _parse_json(chat.template_kwargs_json, "chat.chat_template_kwargs_json", dict) or {}
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

    def tokenize_prompt(self, prompt: str | list[int] | ChatPrompt, add_special_tokens: bool | None) -> list[int]:
        if isinstance(prompt, ChatPrompt):
            # The template already holds every special token the model expects.
            return self.tokenizer.encode(self.render_chat(prompt), add_special_tokens=False)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", field="text")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        for i, token_id in enumerate(prompt):
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"token_ids[{i}] = {token_id} is outside the vocabulary (size {self.vocab_size})",
                    field="token_ids",
                )
        return list(prompt)

    def process(
        self,
        request_id: str,
        prompt: str | list[int] | ChatPrompt,
        params: SamplingParams,
        add_special_tokens: bool | None = None,
    ) -> EngineRequest:
        prompt_ids = self.tokenize_prompt(prompt, add_special_tokens)
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
        return EngineRequest(request_id=request_id, prompt_token_ids=prompt_ids, params=params)


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
