"""Llama 3 JSON format: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`; several calls separated by `;`)."""

from __future__ import annotations

import json

from rest_proxy.tool_parsers.base import (PartialCall, Region, ToolParser, leading_region, leading_text,
                                          scan_call_sequence)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def find_region(self, text: str) -> Region:
        return leading_region(text, "{", (PYTHON_TAG,))

    def text_regexes(self) -> tuple[str, str]:
        return leading_text("{", (PYTHON_TAG,))

    def parse_region(self, region: str, final: bool) -> list[PartialCall]:
        start = region.find(PYTHON_TAG) + len(PYTHON_TAG) if region.startswith(PYTHON_TAG) else 0
        return scan_call_sequence(region, start, final)[0]

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(f'{{"name": {json.dumps(n)}, "parameters": {a}}}' for n, a in calls)

    def call_prefix(self, name: str | None) -> str:
        return '{"name": ' + (f'{json.dumps(name)}, "parameters": ' if name else '"')
