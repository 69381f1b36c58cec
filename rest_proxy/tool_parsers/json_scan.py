"""A tolerant scanner for JSON that may still be arriving: it finds where values start and end.

It never builds values; callers slice the raw text, so the arguments they stream grow by appending.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"
_CLOSE = {"{": "}", "[": "]"}


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def scan_string(s: str, i: int) -> int | None:
    """`s[i]` is a quote; the index after the closing quote, or None if the string is unfinished."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def scan_value(s: str, i: int) -> int | None:
    """The index just past the JSON value starting at `s[i]`, or None while it is unfinished.

    Raises ValueError on text that cannot be JSON.
    """
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return scan_string(s, i)
    if c in _CLOSE:
        stack = [_CLOSE[c]]
        i += 1
        while i < len(s):
            c = s[i]
            if c == '"':
                end = scan_string(s, i)
                if end is None:
                    return None
                i = end
                continue
            if c in _CLOSE:
                stack.append(_CLOSE[c])
            elif c in "}]":
                if c != stack.pop():
                    raise ValueError(f"mismatched {c!r} at {i}")
                if not stack:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    if j == len(s):
        return None  # a number or literal may go on
    token = s[i:j]
    try:
        json.loads(token)
    except ValueError:
        raise ValueError(f"not JSON: {token!r}") from None
    return j


@dataclass
class ObjectScan:
    """Members of a (possibly unfinished) JSON object: key -> (value start, value end or None)."""

    members: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None
    malformed: bool = False


def scan_object(s: str, i: int) -> ObjectScan:
    """Scan the object starting at `s[i] == "{"` as far as the text goes."""
    out = ObjectScan()
    i = skip_ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        out.end = i + 1
        return out
    try:
        while i < len(s):
            if s[i] != '"':
                raise ValueError("expected a key")
            key_end = scan_string(s, i)
            if key_end is None:
                return out
            key = json.loads(s[i:key_end])
            i = skip_ws(s, key_end)
            if i >= len(s):
                return out
            if s[i] != ":":
                raise ValueError("expected ':'")
            i = skip_ws(s, i + 1)
            if i >= len(s):
                return out
            value_end = scan_value(s, i)
            out.members[key] = (i, value_end)
            if value_end is None:
                return out
            i = skip_ws(s, value_end)
            if i >= len(s):
                return out
            if s[i] == "}":
                out.end = i + 1
                return out
            if s[i] != ",":
                raise ValueError("expected ',' or '}'")
            i = skip_ws(s, i + 1)
    except ValueError:
        out.malformed = True
    return out
