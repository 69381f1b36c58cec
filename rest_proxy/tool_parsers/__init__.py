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
# `--tool-call-parser auto` (the default): chosen from the model's chat template, else by this table.
AUTO = "auto"
# The engine's model family (GetModelInfo.family, HF model_type) -> the format its models are trained
# to write. A family not listed gets the generic JSON parser.
FAMILY_PARSERS = {
    "llama": "llama3_json",
    "llama4": "pythonic",
    "mistral": "mistral",
    "mixtral": "mistral",
    "qwen2": "hermes",
    "qwen3": "hermes",
    "qwen2_moe": "hermes",
    "qwen3_moe": "hermes",
    # Gemma's function calling is Python calls (`[get_weather(city="Paris")]`), no special tokens.
    "gemma2": "pythonic",
    "gemma3_text": "pythonic",
    "phi3": "json",
    "stablelm": "json",
    "glm4": "json",
}


def get_parser(name: str) -> ToolParser:
    """The parser called `name` (or an alias; not `auto`); ValueError names the known ones."""
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        known = ", ".join(sorted(PARSERS) + sorted(ALIASES))
        raise ValueError(f"unknown tool parser {name!r}; known: {known}")
    return PARSERS[key]()


def parser_for_model(override: str | None, family: str, chat_template: str) -> ToolParser:
    """The parser for one model: `override` (`--tool-call-parser NAME`) when set and not `auto`, else
    `select_parser` on the model's family and chat template."""
    if override and override != AUTO:
        return get_parser(override)
    return select_parser(family, chat_template)


def select_parser(family: str, chat_template: str) -> ToolParser:
    """Pick the format a model writes from its chat template first, then its family (`FAMILY_PARSERS`).

    The template is the better witness: SmolLM2 is family "llama" but speaks ChatML (`<|im_start|>`),
    and ChatML models are trained on Hermes-style `<tool_call>` blocks.
    """
    template = chat_template or ""
    if "<parameter=" in template:  # Qwen3-Coder: `<function=NAME>` holding one `<parameter=ARG>` per argument
        return Qwen3CoderToolParser()
    if "<tool_call>" in template or "<|im_start|>" in template:
        return HermesToolParser()
    if "[TOOL_CALLS]" in template:
        return MistralToolParser()
    if "<|python_start|>" in template:
        return PythonicToolParser()
    if "<function=" in template:
        return FunctionTagToolParser()
    if "<|start_header_id|>" in template or "<|python_tag|>" in template:
        return Llama3JsonToolParser()
    return PARSERS[FAMILY_PARSERS.get(family, GenericJsonToolParser.name)]()


__all__ = ["AUTO", "FAMILY_PARSERS", "PARSERS", "ArgumentsDelta", "CallStart", "ContentDelta", "Delta", "PartialCall",
           "ToolCallExtractor", "ToolParser", "get_parser", "new_call_id", "parser_for_model",
           "select_parser"]
