"""Rendering chat templates the way Hugging Face's `apply_chat_template` does, with checked inputs."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inference_service.errors import InvalidRequestError

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` blocks (training-time markers) and renders
    their body unchanged, so templates that use them still compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja's built-in, no HTML escaping (templates embed JSON in prompts, not in HTML).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile (and cache) a chat template in a sandbox; `InvalidRequestError` if it does not parse."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the model's chat template does not compile: {exc}", field="chat") from exc


def load_chat_template(path: str) -> str:
    """A chat template from a file (`--chat-template`), checked to compile; ValueError says why not."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        compile_template(source)
    except InvalidRequestError as exc:
        raise ValueError(f"--chat-template {path}: {exc}") from None
    return source


def validate_messages(messages: Any) -> None:
    """Raise `InvalidRequestError` naming the field (`chat.messages[1].role`) for malformed messages.

    A message is a dict with a string `role`; `content` is a string, None/absent, or a list of
    `{"type": "text", "text": str}` parts."""
    if not isinstance(messages, list):
        raise InvalidRequestError("chat messages must be a list", field="chat.messages")
    for i, message in enumerate(messages):
        where = f"chat.messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object", field=where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where}.role must be a non-empty string", field=f"{where}.role")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(f"{where}.content must be a string, null or a list of text parts",
                                      field=f"{where}.content")
        for j, part in enumerate(content):
            part_where = f"{where}.content[{j}]"
            if not isinstance(part, dict) or part.get("type", "text") != "text" \
                    or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{part_where} must be a text part {{\"type\": \"text\", \"text\": ...}}",
                                          field=part_where)


def render_chat_template(
    source: str,
    messages: list[dict],
    *,
    tools: list[dict] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    special_tokens: dict[str, str | None],
    **template_kwargs: Any,
) -> str:
    """Render `messages` with the template `source`, as `transformers`' `apply_chat_template(tokenize=False)`.

    With `continue_final_message`, the text ends right after the final message's content, so the
    model continues it rather than starting a new turn."""
    validate_messages(messages)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InvalidRequestError("tools must be a list of objects", field="chat.tools")
    template = compile_template(source)
    # A deep copy through JSON types: the template cannot touch the caller's objects.
    try:
        chat = [_alias_reasoning(message) for message in json.loads(json.dumps(messages))]
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"chat messages must be JSON values: {exc}", field="chat.messages") from exc
    final_text = None
    if continue_final_message:
        if not chat:
            raise InvalidRequestError("continue_final_message needs a final message", field="chat.messages")
        final_text = _tag_final_message(chat[-1], len(chat) - 1)
    try:
        rendered = template.render(
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**{k: v for k, v in special_tokens.items()}, **template_kwargs},
        )
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"chat template error: {exc.message or exc}", field="chat") from exc
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise InvalidRequestError(f"chat template error: {exc}", field="chat") from exc
    if final_text is not None:
        rendered = _cut_after_final_message(rendered, final_text)
    return rendered


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    """Expose a message's reasoning under every name templates read it by (as transformers does)."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(message: dict, index: int) -> str:
    """Append a marker to the final message's (last) text, to find where that text ends once rendered."""
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = content + _CONTINUE_TAG
        return content
    for part in reversed(content or []):
        if "text" in part:
            text = part["text"]
            part["text"] = text + _CONTINUE_TAG
            return text
    raise InvalidRequestError("continue_final_message needs text in the final message",
                              field=f"chat.messages[{index}].content")


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise InvalidRequestError("the chat template drops part of the final message, so it cannot be continued",
                                  field="chat.messages")
    loc = rendered.rindex(tag)
    if rendered[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    # The template trimmed the marker's trailing space, so trailing spacing of the message went too.
    return rendered[:loc].rstrip()
