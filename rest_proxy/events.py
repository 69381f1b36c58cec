"""The events a generation yields on its way to a response: chat deltas and finishes, completion text,
and the usage that closes every stream. Non-streaming answers add them up; streams write them as chunks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """What one engine response added to chat choice `index`: its message deltas (content, reasoning,
    refusal or tool-call pieces, in order; may be empty) and its logprobs (None unless asked for)."""

    index: int
    deltas: list[dict]
    logprobs: list[dict] | None


@dataclass(frozen=True, slots=True)
class ChatFinish:
    """Chat choice `index` ended, for `reason` ("stop", "length", "tool_calls", ...)."""

    index: int
    reason: str


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one engine response added to completion `index` (prompt position x n + choice): text (the echoed
    prompt ahead of the first), logprobs in the completions layout (None unless asked for), and the finish
    reason on its last."""

    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """The prompt logprobs of prompt `index` (completions: position in the request's prompt list; chat: 0) in
    vLLM's layout (see `translate.vllm_prompt_logprobs`). Only non-streaming answers carry them."""

    index: int
    entries: list[dict | None]


@dataclass(frozen=True, slots=True)
class McpCall:
    """A call of an MCP tool the proxy ran between rounds (chat completions do not show them; the
    Responses API writes each as an `mcp_call` output item). `output` is what the model was given."""

    server_label: str
    name: str  # the tool's own name on its server
    arguments: str  # JSON, as the model wrote it
    output: str
    is_error: bool


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """The token counts of the whole request: always the last event."""

    usage: dict


ChatEvent = ChatDelta | ChatFinish | PromptLogprobs | McpCall | StreamUsage
CompletionEvent = TextDelta | PromptLogprobs | StreamUsage
