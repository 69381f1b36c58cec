"""Qwen3-Coder format: XML-ish calls whose arguments are one tag per parameter, values as plain text.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values carry no JSON types, so the tool's parameter schema gives them: integer, number, boolean, null,
object and array values are read as JSON (the model writes them so), strings and parameters the schema does
not type stay raw text. The arguments are streamed as the JSON object OpenAI streams: `{`, then each member
once its value is known, a string's value as it grows, then `}` at `</function>`.
"""

from __future__ import annotations

import ast
import json

from rest_proxy.tool_parsers.base import _COMPACT_JSON, MarkerToolParser, PartialCall, marker_text

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_MARKERS = (CALL_OPEN, FUNC_OPEN)
_RAW_TYPES = (None, "string")


def _type_of(schema: dict | None) -> str | None:
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def convert_value(raw: str, schema: dict | None) -> object:
    """A parameter's text as the JSON value its schema types; text that does not parse stays text."""
    kind = _type_of(schema)
    if kind in _RAW_TYPES:
        return raw
    text = raw.strip()
    if text.lower() == "null":
        return None
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        value = json.loads(text)
    except ValueError:
        if kind not in ("object", "array"):
            return raw
        try:  # Python literals (single quotes, True) as some models write them
            value = ast.literal_eval(text)
            json.dumps(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return raw
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        value = int(value)
    return value


class Qwen3CoderToolParser(MarkerToolParser):
    name = "qwen3_coder"
    markers = _MARKERS

    def __init__(self) -> None:
        self.properties: dict[str, dict] = {}  # tool name -> its parameters' schemas

    def set_tools(self, tools: list[dict]) -> None:
        self.properties = {}
        for tool in tools:
            fn = tool.get("function", tool)
            params = fn.get("parameters") or {}
            self.properties[fn.get("name", "")] = params.get("properties") or {} if isinstance(params, dict) else {}

    def parse_region(self, region: str, final: bool) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = region.find(FUNC_OPEN)
        while pos >= 0:
            name_end = region.find(">", pos + len(FUNC_OPEN))
            if name_end < 0:
                break
            name = region[pos + len(FUNC_OPEN):name_end].strip()
            if not name or "\n" in name:
                break
            call, end = self._parse_call(region, name, name_end + 1, final)
            calls.append(call)
            if end is None:
                break
            pos = region.find(FUNC_OPEN, end)
        return calls

    def _parse_call(self, s: str, name: str, i: int, final: bool) -> tuple[PartialCall, int | None]:
        """The call whose parameters start at `s[i]`, and the index after its `</function>` (None if open)."""
        schemas = self.properties.get(name, {})
        members: list[str] = []
        while True:
            p, f = s.find(PARAM_OPEN, i), s.find(FUNC_CLOSE, i)
            if f >= 0 and (p < 0 or f < p):
                return PartialCall(name, "{" + ", ".join(members) + "}", True), f + len(FUNC_CLOSE)
            key_end = s.find(">", p + len(PARAM_OPEN)) if p >= 0 else -1
            if key_end < 0:
                break
            key = s[p + len(PARAM_OPEN):key_end].strip()
            start = key_end + 1 + (s.startswith("\n", key_end + 1))
            end = s.find(PARAM_CLOSE, start)
            head = f"{json.dumps(key, ensure_ascii=False)}: "
            if end < 0:
                partial = self._partial_member(s, start, schemas.get(key), final)
                if partial is not None:
                    members.append(head + partial)
                break
            members.append(head + _dumps(convert_value(_value_text(s[start:end]), schemas.get(key))))
            i = end + len(PARAM_CLOSE)
        arguments = "{" + ", ".join(members)
        return PartialCall(name, arguments + "}" if final else arguments, final), None

    @staticmethod
    def _partial_member(s: str, start: int, schema: dict | None, final: bool) -> str | None:
        """An unfinished value's JSON so far: a raw string's text as it grows (less a trailing newline or a
        partial closing tag, which may not be part of it), other types only at the end of the output."""
        raw = s[start:]
        if final:
            return _dumps(convert_value(_value_text(raw), schema))
        if _type_of(schema) not in _RAW_TYPES:
            return None
        for k in range(min(len(PARAM_CLOSE) - 1, len(raw)), 0, -1):
            if raw.endswith(PARAM_CLOSE[:k]):
                raw = raw[:-k]
                break
        return _dumps(raw.removesuffix("\n"))[:-1]  # without the closing quote: the value goes on

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        blocks = []
        for name, arguments in calls:
            try:
                args = json.loads(arguments) if arguments else {}
            except ValueError:
                args = {}
            params = "".join(f"{PARAM_OPEN}{key}>\n{value if isinstance(value, str) else _dumps(value)}\n"
                             f"{PARAM_CLOSE}\n" for key, value in (args.items() if isinstance(args, dict) else ()))
            blocks.append(f"{CALL_OPEN}\n{FUNC_OPEN}{name}>\n{params}{FUNC_CLOSE}\n{CALL_CLOSE}")
        return "\n".join(blocks)

    def call_prefix(self, name: str | None) -> str:
        return f"{CALL_OPEN}\n{FUNC_OPEN}" + (f"{name}>\n" if name else "")

    def calls_grammar(self, tools: list[tuple[str, dict | None]], *, named: bool, parallel: bool) -> str:
        """Calls as `render_calls` writes them: each tool's parameters in its schema's order, the required
        ones always, each value to its schema (strings as any text without `</parameter>`)."""
        close = json.dumps(f"\n{PARAM_CLOSE}\n")
        rules = [f"RAW_VALUE: RAW_TEXT {close}", f"RAW_TEXT: {marker_text((PARAM_CLOSE,))[0]}"]
        end = json.dumps(f"{FUNC_CLOSE}\n{CALL_CLOSE}")
        calls = []
        for i, (name, params) in enumerate(tools):
            params = params if isinstance(params, dict) else {}
            required = set(params.get("required") or ())
            parts = []
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                rule = f"param_{i}_{j}"
                if _type_of(schema) in _RAW_TYPES:
                    value = _raw_value_grammar(schema)
                else:
                    value = f"{rule}_json {close}"
                    rules.append(f"{rule}_json: %json {json.dumps({'x-guidance': _COMPACT_JSON, **schema})}")
                rules.append(f"{rule}: {json.dumps(f'{PARAM_OPEN}{key}>' + chr(10))} {value}")
                parts.append(rule if key in required else f"{rule}?")
            head = [] if named else [json.dumps(f"{name}>\n")]
            calls.append(" ".join([*head, *parts, end]))
        body = f"({' | '.join(calls)})"
        more = f" ({json.dumps(chr(10) + self.call_prefix(None))} {body})*" if parallel and not named else ""
        return "\n".join([f"start: {body}{more}", *rules])

    def render_tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


def _raw_value_grammar(schema: dict | None) -> str:
    """A raw-text value through its closing tag: any text, or one of a string enum's values."""
    choices = (schema or {}).get("enum")
    if choices and all(isinstance(c, str) for c in choices):
        return "(" + " | ".join(json.dumps(f"{c}\n{PARAM_CLOSE}\n") for c in choices) + ")"
    return "RAW_VALUE"


def _value_text(raw: str) -> str:
    return raw.removesuffix("\n")


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)
