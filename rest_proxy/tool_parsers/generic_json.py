"""Generic JSON: the whole answer is a call object `{"name": ..., "arguments": {...}}` or an array of them."""

from __future__ import annotations

import json

from rest_proxy.tool_parsers.base import (PartialCall, Region, ToolParser, leading_region, leading_text,
                                          scan_call_sequence)


class GenericJsonToolParser(ToolParser):
    name = "json"

    def find_region(self, text: str) -> Region:
        return leading_region(text, "{[")

    def text_regexes(self) -> tuple[str, str]:
        return leading_text("{[")

    def parse_region(self, region: str, final: bool) -> list[PartialCall]:
        return scan_call_sequence(region, 0, final)[0]

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        objects = [f'{{"name": {json.dumps(n)}, "arguments": {a}}}' for n, a in calls]
        return objects[0] if len(objects) == 1 else "[" + ", ".join(objects) + "]"

    def call_prefix(self, name: str | None) -> str:
        return '{"name": ' + (f'{json.dumps(name)}, "arguments": ' if name else '"')
