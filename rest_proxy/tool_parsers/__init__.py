"""Tool-call parsers, one file per format, and the choice of one for a model."""

from __future__ import annotations

from rest_proxy.tool_parsers.base import (ArgumentsDelta, CallStart, ContentDelta, Delta, PartialCall,
                                          ToolCallExtractor, ToolParser, new_call_id)
from rest_proxy.tool_parsers.function_tag import FunctionTagToolParser
from rest_proxy.tool_parsers.generic_json import GenericJsonToolParser
from rest_proxy.tool_parsers.hermes import HermesToolParser
from rest_proxy.tool_parsers.llama3_json import Llama3JsonToolParser
from rest_proxy.tool_parsers.mistral import MistralToolParser
from rest_proxy.tool_parsers.pythonic import PythonicToolParser
from rest_proxy.tool_parsers.qwen3_coder import Qwen3CoderToolParser

PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, MistralToolParser, Llama3JsonToolParser,
                              FunctionTagToolParser, PythonicToolParser, GenericJsonToolParser, Qwen3CoderToolParser)
}
ALIASES = {"qwen": "hermes", "qwen2": "hermes", "qwen3": "hermes", "llama3": "llama3_json",
           "llama": "llama3_json", "generic": "json",
           "qwen_coder": "qwen3_coder", "qwen3_xml": "qwen3_coder"}


def get_parser(name: str) -> ToolParser:
    """The parser called `name` (or an alias); ValueError names the known ones."""
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        known = ", ".join(sorted(PARSERS) + sorted(ALIASES))
        raise ValueError(f"unknown tool parser {name!r}; known: {known}")
    return PARSERS[key]()


def select_parser(family: str, chat_template: str) -> ToolParser:
    """Pick the format a model writes from its chat template first, then its family.

    The template is the better witness: SmolLM2 is family "llama" but speaks ChatML (`<|im_start|>`),
    and ChatML models are trained on Hermes-style `<tool_call>` blocks.
    """
    template = chat_template or ""
    if "<parameter=" in template:  # Qwen3-Coder: `<function=NAME>` holding one `<parameter=ARG>` per argument
        return Qwen3CoderToolParser()
    if "<tool_call>" in template or "<|im_start|>" in template:
        return HermesToolParser()
    if "[TOOL_CALLS]" in template or family in ("mistral", "mixtral"):
        return MistralToolParser()
    if "<|python_start|>" in template or family == "llama4":
        return PythonicToolParser()
    if "<function=" in template:
        return FunctionTagToolParser()
    if "<|start_header_id|>" in template or "<|python_tag|>" in template or family == "llama":
        return Llama3JsonToolParser()
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        return HermesToolParser()
    return GenericJsonToolParser()


__all__ = ["PARSERS", "ArgumentsDelta", "CallStart", "ContentDelta", "Delta", "PartialCall",
           "ToolCallExtractor", "ToolParser", "get_parser", "new_call_id", "select_parser"]
