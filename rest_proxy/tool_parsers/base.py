"""Tool-call parsing shared by all formats, and the streaming extractor built on it.

A parser says where tool markup starts and turns the markup region into calls. The extractor feeds it
text as it arrives and emits OpenAI-style deltas: content before the markup, a call's start (index,
id, name) once its name is known, then fragments of its arguments. Arguments are slices of the
model's own text, so they only ever grow; the non-streaming result is the extractor run on the whole
text at once, which is why any chunking reassembles to exactly that result.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from rest_proxy.tool_parsers.json_scan import ObjectScan, scan_object, scan_value, skip_ws

_WS = " \t\r\n"
_ARGUMENT_KEYS = ("arguments", "parameters")


# Arguments spaced as `json.dumps` spaces them (as `render_calls` shows calls to the model): given free
# whitespace, a small model can spend its tokens on newlines and never close the call.
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class PartialCall:
    """A call as far as parsed: `arguments` is the text so far (complete once `complete`)."""

    name: str
    arguments: str
    complete: bool


@dataclass
class Region:
    """Where markup begins (`start`), or how much text is safe to show as content (`safe_end`)."""

    start: int | None
    safe_end: int


@dataclass
class ContentDelta:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgumentsDelta:
    index: int
    text: str


Delta = ContentDelta | CallStart | ArgumentsDelta


class ToolParser(ABC):
    """One tool-call format."""

    name: ClassVar[str]

    @abstractmethod
    def find_region(self, text: str) -> Region:
        """Locate the start of tool markup in the output so far."""

    @abstractmethod
    def parse_region(self, region: str, final: bool) -> list[PartialCall]:
        """Calls in the markup region so far (only those whose name is known)."""

    @abstractmethod
    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """The markup for (name, arguments JSON) calls, used for history in prompts."""

    @abstractmethod
    def call_prefix(self, name: str | None) -> str:
        """Text that starts a call (to `name`, when given) in this format; used to force a call."""

    def calls_grammar(self, tools: list[tuple[str, dict | None]], *, named: bool, parallel: bool) -> str | None:
        """A Lark grammar (llguidance's dialect, with `%json`) for what follows `call_prefix` in a forced call:
        a call to one of `tools` ((name, parameters JSON schema) pairs; with `named`, the only one, whose name
        the prefix already holds) with arguments matching its schema, then, with `parallel`, any number of
        further calls, then the closing markup. Built from this format's own `render_calls`; None where the
        arguments are not JSON text (pythonic) or the markup does not decompose that way."""
        first_args, second_args = "\x00arguments-1\x00", "\x00arguments-2\x00"
        prefix = self.call_prefix(tools[0][0] if named else None)

        def segments(calls: list[tuple[str, str]]) -> list[str] | None:
            # The rendered calls minus the prefix, cut at each placeholder: [before, between..., after].
            text = self.render_calls(calls)
            marks = [c[1] for c in calls]
            if not text.startswith(prefix) or any(text.count(m) != 1 for m in marks):
                return None
            out, rest = [], text[len(prefix):]
            for mark in marks:
                head, _, rest = rest.partition(mark)
                out.append(head)
            return [*out, rest]

        def literal(text: str) -> list[str]:
            return [json.dumps(text)] if text else []

        firsts, mores, ends = [], [], set()
        for i, (name, _) in enumerate(tools):
            one = segments([(name, first_args)])
            if one is None:
                return None
            firsts.append(" ".join([*literal(one[0]), f"args_{i}"]))
            ends.add(one[1])
            if parallel and not named:
                two = segments([(tools[0][0], first_args), (name, second_args)])
                if two is None or two[2] != one[1]:
                    return None
                mores.append(" ".join([*literal(two[1]), f"args_{i}"]))
        if len(ends) != 1:
            return None
        body = [f"({' | '.join(firsts)})"] + ([f"({' | '.join(mores)})*"] if mores else []) + literal(ends.pop())
        rules = [f"args_{i}: %json {json.dumps({'x-guidance': _COMPACT_JSON, **(params or {'type': 'object'})})}"
                 for i, (_, params) in enumerate(tools)]
        return "\n".join([f"start: {' '.join(body)}", *rules])

    def set_tools(self, tools: list[dict]) -> None:
        """The tools (OpenAI tool objects) of this request, for formats whose calls need their schemas to be
        read (Qwen3-Coder's untyped values); the others ignore them."""

    def text_regexes(self) -> tuple[str, str] | None:
        """(text that opens no call, text that may come before a call's `call_prefix`) as llguidance Lark
        terminal bodies, for `text_or_calls_grammar`; None where this format cannot say."""
        return None

    def text_or_calls_grammar(self, tools: list[tuple[str, dict | None]], *, parallel: bool) -> str | None:
        """A Lark grammar for a whole answer under tool_choice `auto` that holds calls to their schemas: text
        that opens no call, or text, then calls to `tools` as `calls_grammar` constrains them (and nothing
        after their closing markup). The model may answer in words, but any call it opens is valid. None
        where the format has no such grammar."""
        calls, text = self.calls_grammar(tools, named=False, parallel=parallel), self.text_regexes()
        if calls is None and parallel:  # a format whose several calls are not one call's markup repeated
            calls = self.calls_grammar(tools, named=False, parallel=False)
        if calls is None or text is None:
            return None
        start, *rules = calls.split("\n")
        free, before = text
        # NOTE: the text before a call and the call's opening are one terminal, so the lexer never has to
        # decide where free text ends: the text cannot hold the opening, the terminal ends with it.
        return "\n".join([f"start: TEXT | OPEN {start.removeprefix('start: ')}", f"TEXT: {free}",
                          f"OPEN: {before} {json.dumps(self.call_prefix(None))}", *rules])

    def system_prompt(self, tools: list[dict]) -> str:
        """Instructions describing the tools, for chat templates that cannot render tools."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        example = self.render_calls([("<function-name>", '{"<arg>": "<value>"}')])
        return ("You may call one or more functions to answer the user. Available functions:\n"
                f"{listing}\nTo call a function, answer with nothing else but:\n{example}")

    def render_tool_result(self, content: str) -> str:
        return content


def marker_region(text: str, markers: tuple[str, ...]) -> Region:
    """Region for formats introduced by a marker anywhere in the text; holds back a partial marker."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return Region(min(found), min(found))
    hold = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                hold = max(hold, k)
                break
    return Region(None, len(text) - hold)


_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")  # the regex syntax's own (its `\<` is a word boundary), and Lark's `/`


def regex_literal(text: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_META else c for c in text)


def marker_text(markers: tuple[str, ...]) -> tuple[str, str]:
    """`text_regexes` of formats introduced by a marker anywhere: any text without the markers."""
    free = "/(?s:.*)/ & ~/(?s:.*)(" + "|".join(regex_literal(m) for m in markers) + ")(?s:.*)/"
    return free, "TEXT"


class MarkerToolParser(ToolParser):
    """A format whose calls open with one of `markers`, anywhere in the text."""

    markers: ClassVar[tuple[str, ...]]

    def find_region(self, text: str) -> Region:
        return marker_region(text, self.markers)

    def text_regexes(self) -> tuple[str, str]:
        return marker_text(self.markers)


def leading_text(openers: str, prefixes: tuple[str, ...] = ()) -> tuple[str, str]:
    """`text_regexes` of formats whose calls make up the whole output: text not starting (after whitespace)
    with an opener or a prefix; only whitespace before a call."""
    starts = [regex_literal(c) for c in openers] + [regex_literal(p) for p in prefixes]
    return f"/(?s:.*)/ & ~/[ \\t\\r\\n]*({'|'.join(starts)})(?s:.*)/", "/[ \\t\\r\\n]*/"


NEVER = Region(None, -1)  # safe_end -1: this output has no markup at all


def leading_region(text: str, openers: str, prefixes: tuple[str, ...] = ()) -> Region:
    """Region for formats whose calls make up the whole output: decided by its first characters."""
    i = skip_ws(text, 0)
    if i == len(text):
        return Region(None, 0)
    rest = text[i:]
    if rest[0] in openers or any(rest.startswith(p) for p in prefixes):
        return Region(i, i)
    if any(p.startswith(rest) for p in prefixes):
        return Region(None, 0)
    return NEVER


def call_from_object(s: str, scan: ObjectScan, final: bool) -> PartialCall | None:
    name_span = scan.members.get("name")
    if name_span is None or name_span[1] is None:
        return None
    try:
        name = json.loads(s[name_span[0]:name_span[1]])
    except ValueError:
        return None
    if not isinstance(name, str) or not name:
        return None
    args_span = next((scan.members[k] for k in _ARGUMENT_KEYS if k in scan.members), None)
    if args_span is None:
        complete = scan.end is not None or scan.malformed or final
        return PartialCall(name, "{}" if complete else "", complete)
    start, end = args_span
    if end is None:
        if s[start] == '"':  # arguments as a JSON string: wait for all of it
            return PartialCall(name, "", False)
        return PartialCall(name, s[start:].rstrip(_WS), False)
    raw = s[start:end]
    if raw.startswith('"'):
        raw = json.loads(raw)
    return PartialCall(name, raw, True)


def scan_call_sequence(s: str, i: int, final: bool) -> tuple[list[PartialCall], int | None]:
    """Calls in `{...}`, `[{...}, ...]` or `{...}; {...}` starting at `s[i]`.

    Returns the calls and the index after the sequence (None while unfinished).
    """
    calls: list[PartialCall] = []
    i = skip_ws(s, i)
    in_array = i < len(s) and s[i] == "["
    if in_array:
        i = skip_ws(s, i + 1)
    while i < len(s):
        if in_array and s[i] == "]":
            return calls, i + 1
        if s[i] != "{":
            return calls, i
        scan = scan_object(s, i)
        call = call_from_object(s, scan, final)
        if call is not None:
            calls.append(call)
        if scan.end is None:
            return calls, None if not scan.malformed else len(s)
        i = skip_ws(s, scan.end)
        if i < len(s) and s[i] in ",;":
            i = skip_ws(s, i + 1)
    return calls, None


def raw_json_value(s: str, i: int) -> tuple[str, int | None]:
    """The JSON value starting at `s[i]` as far as it goes, and its end (None while unfinished)."""
    try:
        end = scan_value(s, i)
    except ValueError:
        return s[i:].rstrip(_WS), len(s)
    if end is None:
        return s[i:].rstrip(_WS), None
    return s[i:end], end


class ToolCallExtractor:
    """Turns model output, fed in any chunks, into content and tool-call deltas."""

    def __init__(self, parser: ToolParser, prefix: str = ""):
        self.parser = parser
        self.text = ""
        self._region_start: int | None = None
        self._no_region = False
        self._content_sent = 0
        self._started_content = False
        self._calls: list[tuple[str, str]] = []  # (id, arguments sent)
        self.parsed: list[PartialCall] = []
        self._pending = prefix

    def feed(self, delta: str) -> list[Delta]:
        self.text += self._pending + delta
        self._pending = ""
        return self._step(final=False)

    def finish(self) -> list[Delta]:
        self.text += self._pending
        self._pending = ""
        return self._step(final=True)

    def _content(self, end: int, final: bool) -> list[Delta]:
        """Content up to `end`: leading whitespace dropped, trailing whitespace held until it is inner."""
        chunk = self.text[self._content_sent:end]
        if not self._started_content:
            stripped = chunk.lstrip(_WS)
            self._content_sent += len(chunk) - len(stripped)
            chunk = stripped
        if not final:
            chunk = chunk.rstrip(_WS)
        if not chunk:
            return []
        self._started_content = True
        self._content_sent += len(chunk)
        return [ContentDelta(chunk)]

    def _step(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        if self._region_start is None:
            if self._no_region:
                return self._content(len(self.text), final)
            region = self.parser.find_region(self.text)
            if region.start is None:
                if region.safe_end < 0:
                    self._no_region = True
                    return self._content(len(self.text), final)
                return self._content(len(self.text) if final else region.safe_end, final)
            out += self._content(region.start, final=False)
            self._region_start = region.start
        calls = self.parser.parse_region(self.text[self._region_start:], final)
        self.parsed = calls
        for index, call in enumerate(calls):
            if index == len(self._calls):
                self._calls.append((new_call_id(), ""))
                out.append(CallStart(index, self._calls[index][0], call.name))
            call_id, sent = self._calls[index]
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                out.append(ArgumentsDelta(index, call.arguments[len(sent):]))
                self._calls[index] = (call_id, call.arguments)
        if final and not self._calls:
            # Nothing in the markup parsed as a call: it was text after all.
            self._content_sent = min(self._content_sent, self._region_start)
            out += self._content(len(self.text), final=True)
        return out
