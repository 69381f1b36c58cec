"""One chat completion choice being assembled from engine text, for streaming and non-streaming alike."""

from __future__ import annotations

from rest_proxy.reasoning import ReasoningParser
from rest_proxy.tool_parsers import ArgumentsDelta, CallStart, ContentDelta, ToolCallExtractor, ToolParser


class ChoiceState:
    """Turns one completion's text into OpenAI `delta` objects and keeps what they add up to.

    The non-streaming message is exactly the sum of the deltas, so both modes agree by construction.
    With a forced call (`tool_choice` required or named) nothing but the call is shown; output that
    does not parse as one becomes a `refusal` saying so. With a `reasoning` parser the thinking goes to
    `reasoning_content` (and vLLM's newer `reasoning`) deltas, shown only with `include_reasoning`, and only
    the answer after it reaches the tool-call extractor. `has_reasoning_field`: the message carries those
    fields (null when empty) because the model is a thinking one.
    """

    def __init__(self, parser: ToolParser | None, *, prefix: str = "", parallel: bool = True,
                 forced: str | None = None, reasoning: ReasoningParser | None = None,
                 include_reasoning: bool = True, has_reasoning_field: bool = False):
        self.extractor = ToolCallExtractor(parser, prefix) if parser is not None else None
        self.parallel = parallel
        self.forced = forced
        self.reasoning_parser = reasoning
        self.include_reasoning = include_reasoning
        self.has_reasoning_field = has_reasoning_field or reasoning is not None
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict] = []
        self.logprobs: list[dict] = []
        self.refusal: str | None = None
        self.finish_reason: str | None = None
        self.started = False

    def feed(self, text: str, *, final: bool = False) -> list[dict]:
        out: list[dict] = []
        if self.reasoning_parser is not None:
            thought, text = self.reasoning_parser.finish() if final else self.reasoning_parser.feed(text)
            if thought and self.include_reasoning:
                self.reasoning.append(thought)
                out.append({"reasoning_content": thought, "reasoning": thought})
        if self.extractor is None:
            if text:
                self.content.append(text)
                out.append({"content": text})
            return out
        deltas = self.extractor.feed(text) if text or not final else []
        if final:
            deltas += self.extractor.finish()
        for d in deltas:
            if isinstance(d, ContentDelta):
                if self.forced is None:
                    self.content.append(d.text)
                    out.append({"content": d.text})
            elif d.index > 0 and not self.parallel:
                continue
            elif isinstance(d, CallStart):
                self.calls.append({"id": d.id, "type": "function",
                                   "function": {"name": d.name, "arguments": ""}})
                out.append({"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                            "function": {"name": d.name, "arguments": ""}}]})
            elif isinstance(d, ArgumentsDelta):
                self.calls[d.index]["function"]["arguments"] += d.text
                out.append({"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]})
        if final and self.forced is not None and not self.calls:
            self.refusal = f"The model did not produce a valid call to {self.forced}."
            out.append({"refusal": self.refusal})
        return out

    def finish(self, reason: str) -> str:
        if reason == "stop" and self.calls:
            reason = "tool_calls"
        self.finish_reason = reason
        return reason

    def add_deltas(self, deltas: list[dict], lps: list[dict] | None) -> None:
        """Adds up a stream's deltas (as `feed` made them) into the choice a non-streaming answer returns."""
        for d in deltas:
            if "content" in d:
                self.content.append(d["content"])
            if "reasoning_content" in d:
                self.reasoning.append(d["reasoning_content"])
            if "refusal" in d:
                self.refusal = d["refusal"]
            for tc in d.get("tool_calls", []):
                if "id" in tc:
                    self.calls.append({"id": tc["id"], "type": "function",
                                       "function": {"name": tc["function"]["name"], "arguments": ""}})
                else:
                    self.calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
        if lps:
            self.logprobs += lps

    @property
    def text(self) -> str:
        return "".join(self.content)

    def message(self) -> dict:
        text = self.text
        msg: dict = {"role": "assistant", "content": None if ((self.calls or self.reasoning) and not text) else text,
                     "refusal": self.refusal}
        if self.has_reasoning_field:
            thought = "".join(self.reasoning) or None
            msg["reasoning_content"] = msg["reasoning"] = thought
        if self.refusal is not None and not text:
            msg["content"] = None
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg
