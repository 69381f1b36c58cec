"""The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is rewritten as a chat completion (`responses_translate.py`) and run by the chat service, so
templates, tool formats, forced and strict calls, MCP rounds and structured output behave exactly as in
`/v1/chat/completions`; the chat events are then written into a `response` object and its stream events
(`responses_output.py`). Finished responses are kept in a bounded in-memory store for
`previous_response_id` (see `responses_store.py` for what that means behind several replicas).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from rest_proxy.chat import ChatPlan, ChatService
from rest_proxy.errors import ProxyError
from rest_proxy.events import ChatDelta, ChatFinish, McpCall, StreamUsage
from rest_proxy.mcp_manager import exposed_name
from rest_proxy.metrics import ProxyMetrics
from rest_proxy.protocol import ChatMessageParam, FunctionCallParam, ToolCallParam
from rest_proxy.responses_output import ResponseBuilder, new_id
from rest_proxy.responses_protocol import ResponsesRequest
from rest_proxy.responses_store import ResponseStore, StoredResponse
from rest_proxy.responses_translate import chat_request, client_error, function_tools, input_messages
from rest_proxy.sse import typed_event

log = logging.getLogger(__name__)


def split_reasoning(delta: dict) -> tuple[str, dict]:
    """The thinking a chat delta carries (`reasoning_content`, from the chat path's reasoning parser), and
    the rest of it: the builder writes the thinking as a `reasoning` output item ahead of the answer."""
    reasoning = delta.get("reasoning_content") or ""
    return reasoning, {k: v for k, v in delta.items() if k not in ("reasoning_content", "reasoning")}


@dataclass
class ResponseRun:
    """One `/v1/responses` request, planned: the chat plan that generates it and the object it fills."""

    req: ResponsesRequest
    plan: ChatPlan
    builder: ResponseBuilder
    history: list[ChatMessageParam]  # the earlier conversation (previous_response_id) and this input


class ResponsesService:
    def __init__(self, chat: ChatService, store: ResponseStore, metrics: ProxyMetrics):
        self.chat = chat
        self.store = store
        self.metrics = metrics

    async def plan(self, req: ResponsesRequest) -> ResponseRun:
        history: list[ChatMessageParam] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise ProxyError(404, f"Previous response with id {req.previous_response_id!r} not found.",
                                 param="previous_response_id", code="previous_response_not_found")
            history = list(previous.messages)
        inputs = input_messages(req.input)
        try:
            plan = await self.chat.plan(chat_request(req, history, inputs))
        except ProxyError as err:
            raise client_error(err) from None
        tools = [{"type": "function", **t.model_dump(exclude={"type"})} for t in function_tools(req.tools) or []]
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        response = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "model": req.model, "output": [], "error": None, "incomplete_details": None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls, "tool_choice": req.tool_choice or "auto",
            "tools": tools, "previous_response_id": req.previous_response_id, "store": req.store,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "truncation": "disabled", "usage": None, "user": req.user}
        return ResponseRun(req=req, plan=plan, builder=ResponseBuilder(response), history=history + inputs)

    async def _events(self, run: ResponseRun) -> AsyncIterator[dict]:
        """The response's stream events; the first only once the engine has answered, so that errors before
        it keep their HTTP status."""
        builder = run.builder
        reason, usage, started = "stop", None, False
        try:
            async with aclosing(self.chat.events(run.plan)) as events:
                async for event in events:
                    if not started:
                        started = True
                        for out in builder.start():
                            yield out
                    match event:
                        case ChatDelta():
                            for delta in event.deltas:
                                for out in self._apply(builder, delta):
                                    yield out
                        case McpCall():
                            for out in builder.mcp_call(event.server_label, event.name, event.arguments,
                                                        event.output, event.is_error):
                                yield out
                        case ChatFinish():
                            reason = event.reason
                        case StreamUsage():
                            usage = event.usage
        except ProxyError as err:
            raise client_error(err) from None
        for out in builder.finish(reason, usage):
            yield out
        if run.req.store:
            self.store.put(builder.response["id"], StoredResponse(
                response=builder.response, messages=run.history + _output_messages(builder.response["output"])))

    @staticmethod
    def _apply(builder: ResponseBuilder, delta: dict) -> list[dict]:
        reasoning, delta = split_reasoning(delta)
        events = builder.reasoning(reasoning)
        if delta.get("content"):
            events += builder.text(delta["content"])
        if delta.get("refusal"):
            events += builder.refusal(delta["refusal"])
        for call in delta.get("tool_calls", []):
            if "id" in call:
                events += builder.call_start(call["id"], call["function"]["name"])
            events += builder.call_arguments(call["function"].get("arguments") or "")
        return events

    async def complete(self, run: ResponseRun) -> dict:
        async with aclosing(self._events(run)) as events:
            async for _ in events:
                pass
        return run.builder.response

    async def stream(self, run: ResponseRun) -> AsyncIterator[str]:
        """SSE events (`event: TYPE` and its JSON); a failure after the first is a `response.failed` event."""
        started = first_text = False
        t0 = time.perf_counter()
        try:
            async with aclosing(self._events(run)) as events:
                async for event in events:
                    started = True
                    if not first_text and event["type"] == "response.output_text.delta":
                        first_text = True
                        self.metrics.first_token_latency.labels(endpoint="responses").observe(
                            time.perf_counter() - t0)
                    yield typed_event(event)
        except Exception as err:  # once the stream is open, failures are reported in-band
            if not started:
                raise
            if not isinstance(err, ProxyError):
                log.exception("response stream failed")
                err = ProxyError(500, f"internal error: {err}")
            for event in run.builder.fail(err):
                yield typed_event(event)

    def retrieve(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(response_id: str) -> ProxyError:
    return ProxyError(404, f"No response found with id {response_id!r} (responses are kept by the proxy "
                           f"replica that served them, shared by its workers, for a bounded time)", param="response_id",
                      code="response_not_found")


def _output_messages(output: list[dict]) -> list[ChatMessageParam]:
    """A response's output as the turns a follow-up continues from: the MCP calls the proxy ran (each an
    assistant call and its tool result, in the model's own tool names), then the assistant's answer."""
    turns = []
    for item in output:
        if item["type"] == "mcp_call":
            name = exposed_name(item["server_label"], item["name"]) if item["server_label"] else item["name"]
            call = ToolCallParam(id=item["id"], function=FunctionCallParam(name=name,
                                                                           arguments=item["arguments"] or "{}"))
            turns += [ChatMessageParam(role="assistant", content=None, tool_calls=[call]),
                      ChatMessageParam(role="tool", tool_call_id=item["id"], content=_mcp_text(item))]
    text = "".join(part.get("text", "") for item in output if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    calls = [ToolCallParam(id=item["call_id"], function=FunctionCallParam(name=item["name"],
                                                                          arguments=item["arguments"] or "{}"))
             for item in output if item["type"] == "function_call"]
    if text or calls:
        turns.append(ChatMessageParam(role="assistant", content=text or None, tool_calls=calls or None))
    return turns


def _mcp_text(item: dict) -> str:
    """What the model was given for an `mcp_call` item: its output, or its error's text."""
    if item["error"] is None:
        return item["output"] or ""
    return "".join(block.get("text", "") for block in item["error"]["content"])
