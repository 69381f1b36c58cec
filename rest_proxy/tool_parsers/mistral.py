"""Mistral format: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`,
or the newer `[TOOL_CALLS]name[ARGS]{...}` repeated once per call."""

from __future__ import annotations

import json
import re

from rest_proxy.tool_parsers.base import (MarkerToolParser, PartialCall, raw_json_value, scan_call_sequence,
                                          skip_ws)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_\-.]+")


class MistralToolParser(MarkerToolParser):
    name = "mistral"
    markers = (MARKER,)

    def parse_region(self, region: str, final: bool) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = region.find(MARKER)
        while pos >= 0:
            i = skip_ws(region, pos + len(MARKER))
            if i >= len(region):
                break
            if region[i] in "[{":
                found, end = scan_call_sequence(region, i, final)
                calls += found
            else:
                match = _NAME.match(region, i)
                if match is None:
                    break
                j = match.end()
                if not region.startswith(ARGS, j):
                    break  # the name may still be arriving
                args_start = skip_ws(region, j + len(ARGS))
                if args_start >= len(region):
                    calls.append(PartialCall(match.group(), "", False))
                    break
                args, end = raw_json_value(region, args_start)
                calls.append(PartialCall(match.group(), args, end is not None))
            if end is None:
                break
            pos = region.find(MARKER, end)
        return calls

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        body = ", ".join(f'{{"name": {json.dumps(n)}, "arguments": {a}}}' for n, a in calls)
        return f"{MARKER} [{body}]"

    def call_prefix(self, name: str | None) -> str:
        return f'{MARKER} [{{"name": ' + (f'{json.dumps(name)}, "arguments": ' if name else '"')
