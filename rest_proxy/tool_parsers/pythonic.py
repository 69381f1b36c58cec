"""Pythonic format: the whole answer is a Python list of calls, `[get_weather(city="Paris"), f(a=1)]`
(optionally wrapped in `<|python_start|>` ... `<|python_end|>`). Each call's arguments are sent whole,
once the list parses."""

from __future__ import annotations

import ast
import json

from rest_proxy.tool_parsers.base import PartialCall, Region, ToolParser, leading_region

START, END = "<|python_start|>", "<|python_end|>"


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def find_region(self, text: str) -> Region:
        return leading_region(text, "[", (START,))

    def parse_region(self, region: str, final: bool) -> list[PartialCall]:
        body = region.strip()
        if body.startswith(START):
            body = body[len(START):]
        body = body.split(END, 1)[0].strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return []
        if not isinstance(tree, ast.List):
            return []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args or _name(node.func) is None:
                return calls
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            except (ValueError, SyntaxError, TypeError):
                return calls
            calls.append(PartialCall(_name(node.func), json.dumps(args, ensure_ascii=False), True))
        return calls

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        parts = []
        for name, args in calls:
            try:
                values = json.loads(args)
            except ValueError:
                values = {}
            kwargs = ", ".join(f"{k}={v!r}" for k, v in values.items()) if isinstance(values, dict) else ""
            parts.append(f"{name}({kwargs})")
        return "[" + ", ".join(parts) + "]"

    def call_prefix(self, name: str | None) -> str:
        return "[" + (f"{name}(" if name else "")
