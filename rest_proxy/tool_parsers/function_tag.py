"""Llama 3.1 custom-function format: `<function=name>{...}</function>`, one block per call."""

from __future__ import annotations

from rest_proxy.tool_parsers.base import MarkerToolParser, PartialCall, raw_json_value, skip_ws

OPEN, CLOSE = "<function=", "</function>"


class FunctionTagToolParser(MarkerToolParser):
    name = "function_tag"
    markers = (OPEN,)

    def parse_region(self, region: str, final: bool) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = region.find(OPEN)
        while pos >= 0:
            name_end = region.find(">", pos + len(OPEN))
            if name_end < 0:
                break
            name = region[pos + len(OPEN):name_end].strip()
            if not name:
                break
            i = skip_ws(region, name_end + 1)
            if i >= len(region):
                calls.append(PartialCall(name, "{}" if final else "", final))
                break
            if region.startswith(CLOSE, i):
                calls.append(PartialCall(name, "{}", True))
                pos = region.find(OPEN, i)
                continue
            args, end = raw_json_value(region, i)
            calls.append(PartialCall(name, args, end is not None))
            if end is None:
                break
            pos = region.find(OPEN, end)
        return calls

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "".join(f"{OPEN}{name}>{args}{CLOSE}" for name, args in calls)

    def call_prefix(self, name: str | None) -> str:
        return OPEN + (f"{name}>" if name else "")
