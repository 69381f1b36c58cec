"""Checks of the JSON schemas and formats a client sends, with errors naming the client's own field.

A schema the proxy only shows the model (a tool's parameters under `auto`) must be a valid JSON Schema
(its metaschema, via `jsonschema`); one the output is constrained to (a forced or `strict` call,
`response_format`, `guided_json`) must also compile in llguidance, as the engine will compile it. Checking
here lets the 400 name `tools[0].function.parameters` rather than the engine's `sampling.structured_output`
field, and keeps the proxy's internal grammars out of the message.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema
from llguidance import LLMatcher

from rest_proxy.errors import invalid_request

# llguidance quotes the grammar around an error as numbered lines ("   1 | start: /((/"): for formats the
# proxy wrapped (a regex, a list of choices) those lines are the proxy's text, not the client's.
_GRAMMAR_CONTEXT = re.compile(r"\n\s*\d+ \|.*", re.DOTALL)
_GRAMMAR_POSITION = re.compile(r"^at \d+\(\d+\): ")  # a line and column in that text


def _compile_error(grammar: str) -> str:
    return LLMatcher.validate_grammar(grammar).strip()


def check_json_schema(schema: Any, param: str, *, constrained: bool) -> None:
    """400 naming `param` unless `schema` is a valid JSON Schema (and, when the output will be
    `constrained` to it, one llguidance compiles)."""
    if not isinstance(schema, (dict, bool)):
        raise invalid_request(f"{param} must be a JSON schema object, got {type(schema).__name__}", param)
    try:
        # No format checks: `pattern` is ECMA 262, which Python's `re` would misjudge; llguidance checks it.
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator) \
            .check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path)
        raise invalid_request(f"{param} is not a valid JSON schema: {err.message}"
                              + (f" (at {where!r})" if where else ""), param) from None
    if constrained:
        try:
            error = _compile_error(LLMatcher.grammar_from_json_schema(schema))
        except ValueError as err:
            error = str(err)
        if error:
            raise invalid_request(f"{param} cannot be used to constrain the output: {error}", param)


def check_format(kind: str, value: str, param: str) -> None:
    """400 naming `param` unless a regex or a Lark grammar (`kind` "regex" or "grammar") compiles; "choice"
    is the Lark alternation the proxy built from a list of choices."""
    try:
        if kind == "regex":
            grammar = LLMatcher.grammar_from_regex(value)
        else:
            grammar = LLMatcher.grammar_from_lark(value)
        error = _compile_error(grammar)
    except ValueError as err:
        error = str(err)
    if not error:
        return
    if kind != "grammar":
        error = _GRAMMAR_POSITION.sub("", _GRAMMAR_CONTEXT.sub("", error)).replace(" (in regex)", "")
    raise invalid_request(f"{param} is invalid: {error}", param)


def parse_json_schema(value: Any, param: str) -> Any:
    """A schema given as JSON text (vLLM's `guided_json` may be a string) as an object; 400 if not JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as err:
        raise invalid_request(f"{param} is not valid JSON: {err}", param) from None


def strict_schema(schema: dict | None, param: str) -> dict:
    """The schema a `strict: true` tool's arguments are held to, as OpenAI's strict mode reads it: every
    object takes only its listed properties, and all of them (a field that may be left out is written as
    nullable). An object that explicitly allows other properties cannot be strict: 400 naming `param`."""
    out = copy.deepcopy(schema) if schema is not None else {"type": "object", "properties": {}}

    def visit(node: Any, where: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                visit(item, f"{where}/{i}")
            return
        if not isinstance(node, dict):
            return
        is_object = node.get("type") == "object" or (isinstance(node.get("type"), list)
                                                     and "object" in node["type"]) or "properties" in node
        if is_object:
            extra = node.get("additionalProperties", False)
            if extra is not False:
                raise invalid_request(f"{param}: a strict tool's objects take no other properties than "
                                      f"those listed (additionalProperties must be false, at {where or '/'!r})",
                                      param)
            node["additionalProperties"] = False
            node["required"] = list(node.get("properties", {}))
        for key, child in node.items():
            if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
                if isinstance(child, dict):
                    for name, sub in child.items():
                        visit(sub, f"{where}/{key}/{name}")
            elif key in ("items", "additionalItems", "not", "if", "then", "else", "contains",
                         "anyOf", "allOf", "oneOf", "prefixItems"):
                visit(child, f"{where}/{key}")

    visit(out, "")
    return out
