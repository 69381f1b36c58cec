"""A Responses API `response` object built up from generated text, with the stream events that build it.

Every change goes through one `ResponseBuilder`, which returns the events describing it; a non-streaming
request drops the events and keeps the object, so both modes agree by construction. Items open and close
in output order; each content event names its item (`item_id`, `output_index`) and part (`content_index`):

    response.created, response.in_progress
    response.output_item.added (message)                  response.output_item.added (function_call)
      response.content_part.added (output_text)             response.function_call_arguments.delta ...
        response.output_text.delta ...                      response.function_call_arguments.done
        response.output_text.done                         response.output_item.done
      response.content_part.done
    response.output_item.done                             response.output_item.added (mcp_call)
                                                            response.mcp_call.in_progress
                                                            response.mcp_call_arguments.delta / .done
                                                            response.mcp_call.completed | .failed
                                                          response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed
"""

from __future__ import annotations

import copy
import secrets
import time

from rest_proxy.errors import ProxyError

# An open content part's type -> (the key holding its text, the prefix of its delta and done events).
_PARTS = {"output_text": ("text", "response.output_text"), "refusal": ("refusal", "response.refusal"),
          "reasoning_text": ("text", "response.reasoning_text")}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage_object(usage: dict | None) -> dict:
    """Chat's usage in the Responses API's terms."""
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


class ResponseBuilder:
    """Owns one `response` object (`self.response`) while it is generated."""

    def __init__(self, response: dict):
        self.response = response
        self.sequence_number = 0
        self._item: dict | None = None  # the output item being written
        self._part: dict | None = None  # its content part being written

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> list[dict]:
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def finish(self, finish_reason: str, usage: dict | None) -> list[dict]:
        """Close what is open; `length` makes the response `incomplete` (max_output_tokens)."""
        incomplete = finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        events = self._close_item(status)
        self.response.update(status=status, usage=usage_object(usage),
                             incomplete_details={"reason": "max_output_tokens"} if incomplete else None)
        if not incomplete:
            self.response["completed_at"] = int(time.time())
        events.append(self._event(f"response.{status}", response=self._snapshot()))
        return events

    def fail(self, err: ProxyError) -> list[dict]:
        """The response as it stood when generation failed, with the error."""
        code = "rate_limit_exceeded" if err.status == 429 else ("invalid_prompt" if err.status < 500
                                                                 else "server_error")
        self.response.update(status="failed", error={"code": code, "message": err.message, "param": err.param,
                                                     "type": err.type})
        return [self._event("response.failed", response=self._snapshot())]

    # -- content --------------------------------------------------------------------------------------------
    def text(self, delta: str) -> list[dict]:
        return self._write("message", "output_text", delta)

    def refusal(self, delta: str) -> list[dict]:
        return self._write("message", "refusal", delta)

    def reasoning(self, delta: str) -> list[dict]:
        return self._write("reasoning", "reasoning_text", delta)

    def call_start(self, call_id: str, name: str) -> list[dict]:
        events = self._close_item("completed")
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": "",
                "status": "in_progress"}
        return events + self._add_item(item)

    def call_arguments(self, delta: str) -> list[dict]:
        item = self._item
        if item is None or item["type"] != "function_call" or not delta:
            return []
        item["arguments"] += delta
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self._index(), delta=delta)]

    def mcp_call(self, server_label: str, name: str, arguments: str, output: str, is_error: bool) -> list[dict]:
        """An MCP tool call the proxy ran, whole: the item, its arguments and its outcome."""
        events = self._close_item("completed")
        item = {"id": new_id("mcp"), "type": "mcp_call", "server_label": server_label, "name": name,
                "arguments": "", "output": None, "error": None, "status": "in_progress"}
        events += self._add_item(item)
        where = {"item_id": item["id"], "output_index": self._index()}
        events.append(self._event("response.mcp_call.in_progress", **where))
        item["arguments"] = arguments
        events += [self._event("response.mcp_call_arguments.delta", **where, delta=arguments),
                   self._event("response.mcp_call_arguments.done", **where, arguments=arguments)]
        if is_error:  # the SDK's McpToolExecutionError; its content the MCP text block the model was given
            item["error"] = {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": output}]}
            events.append(self._event("response.mcp_call.failed", **where))
            status = "failed"
        else:
            item["output"] = output
            events.append(self._event("response.mcp_call.completed", **where))
            status = "completed"
        return events + self._close_item(status)

    # -- items and parts ------------------------------------------------------------------------------------
    def _write(self, kind: str, part_type: str, delta: str) -> list[dict]:
        if not delta:
            return []
        events = []
        if self._item is None or self._item["type"] != kind:
            events += self._close_item("completed")
            item = ({"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                     "content": []} if kind == "message" else
                    {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                     "status": "in_progress"})
            events += self._add_item(item)
        if self._part is None or self._part["type"] != part_type:
            events += self._close_part()
            key = _PARTS[part_type][0]
            self._part = {"type": part_type, key: ""}
            if part_type == "output_text":
                self._part.update(annotations=[], logprobs=[])
            self._item["content"].append(self._part)
            events.append(self._event("response.content_part.added", **self._where(), part=copy.deepcopy(self._part)))
        key, prefix = _PARTS[part_type]
        self._part[key] += delta
        extra = {"logprobs": []} if part_type == "output_text" else {}
        events.append(self._event(f"{prefix}.delta", **self._where(), delta=delta, **extra))
        return events

    def _add_item(self, item: dict) -> list[dict]:
        self.response["output"].append(item)
        self._item = item
        return [self._event("response.output_item.added", output_index=self._index(), item=copy.deepcopy(item))]

    def _close_part(self) -> list[dict]:
        part = self._part
        if part is None:
            return []
        self._part = None
        key, prefix = _PARTS[part["type"]]
        extra = {"logprobs": []} if part["type"] == "output_text" else {}
        where = {"item_id": self._item["id"], "output_index": self._index(),
                 "content_index": len(self._item["content"]) - 1}
        return [self._event(f"{prefix}.done", **where, **{key: part[key]}, **extra),
                self._event("response.content_part.done", **where, part=copy.deepcopy(part))]

    def _close_item(self, status: str) -> list[dict]:
        item = self._item
        if item is None:
            return []
        events = self._close_part()
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=self._index(), arguments=item["arguments"]))
        item["status"] = status
        events.append(self._event("response.output_item.done", output_index=self._index(),
                                  item=copy.deepcopy(item)))
        self._item = None
        return events

    def _index(self) -> int:
        return len(self.response["output"]) - 1

    def _where(self) -> dict:
        return {"item_id": self._item["id"], "output_index": self._index(),
                "content_index": len(self._item["content"]) - 1}

    def _snapshot(self) -> dict:
        return copy.deepcopy(self.response)

    def _event(self, type: str, **fields) -> dict:
        event = {"type": type, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return event
