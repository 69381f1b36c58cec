"""Reasoning output: the thinking a model writes in `<think>...</think>`, split from its answer.

A `ReasoningParser` takes one completion's text, in any chunks, and says which part is reasoning and which is
content. Like the tool-call extractor, it recomputes where the two parts lie in the whole text so far and
emits only what is new, so the streamed deltas always add up to the one-shot `extract` of the whole text:

    [ws] [<think>] [ws] reasoning... [ws] </think> [ws] content...
         ^ consumed     ^-------------^ reasoning   ^ dropped  ^ content (verbatim from here)

Whether the output starts inside the thinking is the prompt's business: DeepSeek-R1 and QwQ templates end
the generation prompt with `<think>`, so the model writes only the closing tag; Qwen3's hybrid template
lets the model open it, or closes an empty one itself when `enable_thinking` is false. `prompt_state`
renders the model's chat template once per (template, kwargs) to find out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from inference_service.api import pb
from rest_proxy.tool_parsers.base import marker_text
from rest_proxy.tool_parsers.json_scan import skip_ws

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_WS = " \t\r\n"


class PromptState(Enum):
    """Where the generation prompt leaves the thinking."""

    OPENED = "opened"  # ends inside `<think>`: the output starts in the reasoning
    CLOSED = "closed"  # ends after `</think>` (thinking switched off): the output is all answer
    UNKNOWN = "unknown"  # says nothing: the model opens the thinking itself, or the parser's default holds


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A named reasoning format (`--reasoning-parser NAME`): its tags, and whether output starts in the
    reasoning when the prompt does not say (DeepSeek-R1's parser assumes so, as vLLM's does)."""

    name: str
    is_open_by_default: bool
    open_tag: str = THINK_OPEN
    close_tag: str = THINK_CLOSE

    def parser(self, prompt: PromptState = PromptState.UNKNOWN) -> ReasoningParser | None:
        """A parser for one completion after a prompt in state `prompt`; None where there is no reasoning."""
        if prompt is PromptState.CLOSED:
            return None
        is_open = prompt is PromptState.OPENED or self.is_open_by_default
        return ReasoningParser(is_open=is_open, open_tag=self.open_tag, close_tag=self.close_tag)


FORMATS: dict[str, ReasoningFormat] = {
    f.name: f for f in (ReasoningFormat("deepseek_r1", is_open_by_default=True),
                        ReasoningFormat("qwen3", is_open_by_default=False))
}
ALIASES = {"deepseek-r1": "deepseek_r1", "qwq": "deepseek_r1", "qwen3_thinking": "qwen3"}
NONE = "none"


def get_format(name: str) -> ReasoningFormat | None:
    """The format called `name` (or an alias); None for "none"; ValueError names the known ones."""
    if name == NONE:
        return None
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        known = ", ".join(sorted(FORMATS) + sorted(ALIASES) + [NONE])
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}")
    return FORMATS[key]


def select_format(chat_template: str) -> ReasoningFormat | None:
    """The reasoning format a chat template implies, or None for a model that does not think.

    A template that mentions `<think>` or `enable_thinking` belongs to a thinking model; one with
    `enable_thinking` (Qwen3's hybrid) lets the model open the thinking itself, others (R1, QwQ) open it."""
    template = chat_template or ""
    if THINK_OPEN not in template and "enable_thinking" not in template:
        return None
    return FORMATS["qwen3" if "enable_thinking" in template else "deepseek_r1"]


def prompt_state(chat_template: str, template_kwargs: dict | None, special_tokens: dict[str, str]) -> PromptState:
    """Where the template's generation prompt leaves the thinking, for these kwargs (`enable_thinking`)."""
    kwargs = json.dumps(template_kwargs or {}, sort_keys=True, default=str)
    return _prompt_state(chat_template or "", kwargs, tuple(sorted(special_tokens.items())))


def text_state(text: str) -> PromptState:
    """Where a prompt ending in `text` leaves the thinking (a continued final assistant message)."""
    tail = text.rstrip(_WS)
    opened, closed = tail.rfind(THINK_OPEN), tail.rfind(THINK_CLOSE)
    if opened > closed:
        return PromptState.OPENED
    return PromptState.CLOSED if closed >= 0 else PromptState.UNKNOWN


@lru_cache(maxsize=64)
def _prompt_state(template: str, kwargs_json: str, special_tokens: tuple[tuple[str, str], ...]) -> PromptState:
    from inference_service.errors import InvalidRequestError
    from inference_service.model.chat_template import render_chat_template

    try:
        rendered = render_chat_template(template, [{"role": "user", "content": "."}], tools=None,
                                        add_generation_prompt=True, continue_final_message=False,
                                        special_tokens=dict(special_tokens), **json.loads(kwargs_json))
    except (InvalidRequestError, TypeError, ValueError):
        # NOTE: the engine renders the real prompt and reports the template's errors; here they only mean
        # the prompt cannot tell, and the parser's default decides.
        return PromptState.UNKNOWN
    tail = rendered.rstrip(_WS)
    if tail.endswith(THINK_OPEN):
        return PromptState.OPENED
    return PromptState.CLOSED if tail.endswith(THINK_CLOSE) else PromptState.UNKNOWN


class ReasoningParser:
    """Splits one completion's text into reasoning and content.

    `extract(text)` splits a whole text; `feed(delta)` and `finish()` split it as it arrives and return
    only the new (reasoning, content); their sum over any chunking is exactly `extract` of the whole text
    (a tag split across chunks, and whitespace that may turn out to be trailing, wait for the next chunk).
    Reasoning is None where the text holds none; the reasoning and the content are stripped of surrounding
    whitespace, except content that is the whole text (no thinking at all), which is kept verbatim."""

    def __init__(self, *, is_open: bool, open_tag: str = THINK_OPEN, close_tag: str = THINK_CLOSE):
        self.is_open = is_open
        self.open_tag, self.close_tag = open_tag, close_tag
        self.text = ""
        self._reasoning_sent = 0  # index into `text` up to which reasoning was emitted
        self._content_sent = 0
        self._has_reasoning = False
        self._close_search = 0  # where to look for the closing tag next

    def fresh(self) -> ReasoningParser:
        """A new parser of the same kind, for another completion."""
        return ReasoningParser(is_open=self.is_open, open_tag=self.open_tag, close_tag=self.close_tag)

    def extract(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole text, without touching this parser's stream state."""
        fresh = self.fresh()
        reasoning, content = fresh.feed(text)
        more_reasoning, more_content = fresh.finish()
        return (reasoning + more_reasoning if fresh.has_reasoning else None), content + more_content

    @property
    def has_reasoning(self) -> bool:
        """Whether the text so far has a reasoning part (open tag seen, or output that starts in it)."""
        return self._has_reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        """The reasoning and content `delta` adds (either may be empty)."""
        self.text += delta
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        """What the end of the text releases (held tags and whitespace)."""
        return self._step(final=True)

    def _spans(self, final: bool) -> tuple[tuple[int, int] | None, tuple[int, int]]:
        """((start, end) of the reasoning or None, (start, end) of the content) in the text so far."""
        text, n = self.text, len(self.text)
        i = skip_ws(text, 0)
        rest = text[i:i + len(self.open_tag)]
        if not final and (i == n or (self.open_tag.startswith(rest) and len(rest) < len(self.open_tag))):
            return None, (n, n)  # undecided: the open tag may be on its way
        if rest == self.open_tag:
            start = i + len(self.open_tag)
        elif self.is_open:
            start = 0
        else:
            return None, (0, n)  # no thinking: all content, verbatim
        start = skip_ws(text, start)
        close = text.find(self.close_tag, max(start, self._close_search))
        if close < 0:
            self._close_search = max(start, n - len(self.close_tag) + 1)
            end = n if final else n - _partial_suffix(text, self.close_tag)
            return (start, _rstrip_end(text, start, end)), (n, n)
        content_start = skip_ws(text, close + len(self.close_tag))
        return (start, _rstrip_end(text, start, close)), (content_start, n)

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning, (c_start, c_end) = self._spans(final)
        r_delta = ""
        if reasoning is not None:
            self._has_reasoning = True
            r_start, r_end = reasoning
            begin = max(self._reasoning_sent, r_start)
            if r_end > begin:
                r_delta = self.text[begin:r_end]
                self._reasoning_sent = r_end
        begin = max(self._content_sent, c_start)
        c_delta = ""
        if c_end > begin:
            c_delta = self.text[begin:c_end]
            self._content_sent = c_end
        return r_delta, c_delta


_START_RULE = re.compile(r"\bstart\b")


def answer_after_thinking(fmt: pb.StructuredOutput, parser: ReasoningParser) -> bool:
    """Rewrite the format constraint `fmt` in place so it applies to the answer after the thinking: a Lark
    grammar of the thinking (through its closing tag; opened by the model unless the prompt opened it),
    then the original format. False (and `fmt` unchanged) for a Lark grammar whose `start` rule cannot be
    renamed safely: the constraint then holds from the first token, and there is no thinking to parse."""
    kind = fmt.WhichOneof("format")
    if kind == "json_schema":
        answer = [f"answer: %json {fmt.json_schema}"]
    elif kind == "json_object":
        answer = ['answer: %json {"type": "object"}']
    elif kind == "regex":
        answer = ["answer: ANSWER", "ANSWER: /" + re.sub(r"(?<!\\)/", r"\/", fmt.regex) + "/"]
    elif kind == "lark_grammar":
        grammar = fmt.lark_grammar
        uses = _START_RULE.findall(grammar)
        if len(uses) != 1 or not re.match(r"\s*start\s*:", grammar):
            return False
        answer = [_START_RULE.sub("answer", grammar, count=1)]
    else:
        return False
    free, _ = marker_text((parser.close_tag,))
    ws = "/[ \\t\\r\\n]*/"
    close = f"THINKING {json.dumps(parser.close_tag)} {ws}"
    think = close if parser.is_open else f"{ws} {json.dumps(parser.open_tag)} {close}"
    # NOTE: the thinking, its closing tag and the whitespace after are one terminal, so the lexer never
    # has to decide where free text ends: it cannot hold the closing tag, the terminal ends after it.
    start = "start: THINK answer" if parser.is_open else "start: THINK? answer"
    fmt.lark_grammar = "\n".join([start, f"THINK: {think}", f"THINKING: {free}", *answer])
    return True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _rstrip_end(text: str, start: int, end: int) -> int:
    while end > start and text[end - 1] in _WS:
        end -= 1
    return end


__all__ = ["ALIASES", "FORMATS", "NONE", "PromptState", "ReasoningFormat", "ReasoningParser", "answer_after_thinking",
           "get_format",
           "prompt_state", "select_format", "text_state"]
