"""A Responses API request -> the chat completion request that runs it, and chat errors -> Responses fields.

The chat path does the work (templates, tool formats, MCP rounds, structured output); this module only
rewrites the request in chat's terms: `instructions` a system message, input items chat messages
(`function_call` an assistant tool call, `function_call_output` a tool message), flat function tools
nested under `function`, `text.format` a `response_format`, `max_output_tokens` `max_completion_tokens`.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ValidationError

from rest_proxy.errors import ProxyError, invalid_request
from rest_proxy.protocol import ChatCompletionRequest, ChatMessageParam, FunctionCallParam, ToolCallParam
from rest_proxy.responses_protocol import (ContentPartItem, FunctionCallItem, FunctionCallOutputItem,
                                           FunctionToolChoice, FunctionToolItem, MessageItem, ResponsesRequest)

_TEXT_PARTS = ("input_text", "output_text", "text")
_ITEM_TYPES = "message, function_call, function_call_output, reasoning"


def _parse(model: type[BaseModel], raw: Any, param: str) -> Any:
    """`raw` as `model`; a 400 naming `param` and the failing field otherwise."""
    if not isinstance(raw, dict):
        raise invalid_request(f"{param} must be an object", param)
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        raise invalid_request(f"{where}: {first['msg']}", where) from None


def _text(content: str | list[ContentPartItem], param: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS:
            parts.append(part.text or "")
        elif part.type == "refusal":
            parts.append(part.refusal or "")
        else:
            raise invalid_request(f"content parts of type {part.type!r} are not supported (text only)",
                                  f"{param}[{j}].type")
    return "".join(parts)


def input_messages(items: str | list[Any] | None) -> list[ChatMessageParam]:
    """The request's `input` as chat messages. Reasoning items are dropped: templates show a model only the
    answers of earlier turns."""
    if items is None:
        return []
    if isinstance(items, str):
        return [ChatMessageParam(role="user", content=items)]
    out: list[ChatMessageParam] = []
    for i, raw in enumerate(items):
        where = f"input[{i}]"
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind == "message":
            msg = _parse(MessageItem, raw, where)
            out.append(ChatMessageParam(role=msg.role, content=_text(msg.content, f"{where}.content")))
        elif kind == "function_call":
            call = _parse(FunctionCallItem, raw, where)
            tool_call = ToolCallParam(id=call.call_id, function=FunctionCallParam(name=call.name,
                                                                                  arguments=call.arguments))
            # A turn's text and its calls (parallel ones too) are one assistant message.
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), tool_call]
            else:
                out.append(ChatMessageParam(role="assistant", content=None, tool_calls=[tool_call]))
        elif kind == "function_call_output":
            result = _parse(FunctionCallOutputItem, raw, where)
            out.append(ChatMessageParam(role="tool", tool_call_id=result.call_id,
                                        content=_text(result.output, f"{where}.output")))
        elif kind == "reasoning":
            continue
        elif kind is None:
            raise invalid_request(f"{where} must be an object", where)
        else:
            raise invalid_request(f"input items of type {kind!r} are not supported ({_ITEM_TYPES})",
                                  f"{where}.type")
    return out


def function_tools(tools: list[Any] | None) -> list[FunctionToolItem] | None:
    if tools is None:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise invalid_request(f"tools of type {kind!r} are not supported: only function tools (MCP tools "
                                  f"come from the proxy's --mcp-config and need no entry here)", f"tools[{i}].type")
        out.append(_parse(FunctionToolItem, raw, f"tools[{i}]"))
    return out


def _tool_choice(choice: str | dict | None) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        named = _parse(FunctionToolChoice, choice, "tool_choice")
        return {"type": "function", "function": {"name": named.name}}
    raise invalid_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                          "tool_choice")


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise invalid_request("text.format of type json_schema needs a schema", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "description": fmt.description,
                                                   "schema": fmt.json_schema, "strict": fmt.strict}}


def chat_request(req: ResponsesRequest, history: list[ChatMessageParam],
                 inputs: list[ChatMessageParam]) -> ChatCompletionRequest:
    """The chat completion request that answers `req` after the stored conversation `history`."""
    messages = ([ChatMessageParam(role="system", content=req.instructions)] if req.instructions else [])
    messages += history + inputs
    if not inputs and not history:
        raise invalid_request("input must not be empty", "input")
    tools = function_tools(req.tools)
    body = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "user": req.user,
            "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": _tool_choice(req.tool_choice),
            "response_format": _response_format(req),
            "tools": None if tools is None else [{"type": "function", "function": t.model_dump(exclude={"type"})}
                                                 for t in tools]}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as err:  # the fields were checked above: a mismatch here is the proxy's
        raise ProxyError(500, f"could not translate the request: {err}") from None


# Chat's field names in errors -> the Responses request's (first match wins).
_RENAMES = [(re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^max_(completion_)?tokens"), "max_output_tokens"),
            (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"^messages\b.*"), "input")]


def client_error(err: ProxyError) -> ProxyError:
    """A chat error with its `param` (and the message's mention of it) in the Responses request's terms."""
    old = err.param or ""
    for pattern, repl in _RENAMES:
        new, count = pattern.subn(repl, old, count=1)
        if count:
            message = err.message.replace(old, new) if old in err.message else err.message
            message = re.sub(r"\bmax_tokens\b", "max_output_tokens", message) if new == "max_output_tokens" \
                else message
            return ProxyError(err.status, message, type=err.type, param=new, code=err.code)
    return err
