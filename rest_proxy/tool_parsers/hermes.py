"""Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

A block may also hold a JSON array of calls (SmolLM2 writes `<tool_call>[{...}]</tool_call>`).
"""

from __future__ import annotations

import json

from rest_proxy.tool_parsers.base import MarkerToolParser, PartialCall, scan_call_sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(MarkerToolParser):
    name = "hermes"
    markers = (OPEN,)

    def parse_region(self, region: str, final: bool) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = region.find(OPEN)
        while pos >= 0:
            found, end = scan_call_sequence(region, pos + len(OPEN), final)
            calls += found
            if end is None:
                break
            pos = region.find(OPEN, end)
        return calls

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n{CLOSE}'
                         for name, args in calls)

    def call_prefix(self, name: str | None) -> str:
        return f'{OPEN}\n{{"name": ' + (f'{json.dumps(name)}, "arguments": ' if name else '"')

    def system_prompt(self, tools: list[dict]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You are a function calling AI model. You may call one or more functions to assist with "
                "the user query. Don't make assumptions about what values to plug into functions. "
                f"Here are the available tools: <tools>\n{listing}\n</tools>\n"
                "For each function call return a json object with function name and arguments within "
                f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)

    def render_tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
