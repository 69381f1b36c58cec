"""Client JSON schemas and formats are checked in the proxy, errors name the client's field, and `strict`
tools are constrained under `auto`, driven by the scripted engine (what reaches the engine is exact)."""

from __future__ import annotations

import json

import openai
import pytest

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
BAD = {"type": "function", "function": {"name": "broken", "parameters": {"type": 12}}}
GRAMMAR_TEXT = ("start:", "%json", "lark", "sampling.")


def ask(client, content="weather?", **kw):
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": content}], **kw)


def bad_request(client, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, **kw)
    return exc.value.body


@pytest.mark.parametrize("tool_choice", [None, "auto", "required", "none",
                                         {"type": "function", "function": {"name": "broken"}}])
def test_invalid_tool_schema_is_400_naming_the_tool_under_every_tool_choice(client, engine, tool_choice):
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    body = bad_request(client, tools=[WEATHER, BAD], **extra)
    assert body["param"] == "tools[1].function.parameters"
    assert body["type"] == "invalid_request_error"
    assert body["message"].startswith("tools[1].function.parameters is not a valid JSON schema: ")
    assert "'type'" in body["message"] and not any(t in body["message"] for t in GRAMMAR_TEXT), body
    assert engine.requests == []


def test_schema_that_cannot_constrain_is_400_only_where_calls_are_constrained(client, engine):
    # A valid JSON schema llguidance does not compile (a `pattern` that is not a regex).
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "(("}}}}}
    engine.script["weather?"] = "Just text."
    assert ask(client, tools=[odd]).choices[0].message.content == "Just text."  # auto: shown, never compiled
    body = bad_request(client, tools=[odd], tool_choice="required")
    assert body["param"] == "tools[0].function.parameters"
    assert "cannot be used to constrain the output" in body["message"] and "unclosed group" in body["message"]
    strict = {"type": "function", "function": {**odd["function"], "strict": True}}
    assert bad_request(client, tools=[WEATHER, strict])["param"] == "tools[1].function.parameters"


@pytest.mark.parametrize("kwargs,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"guided_json": {"properties": {"a": {"type": "strang"}}}}}, "guided_json"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"extra_body": {"structured_outputs": {"json": {"required": "a"}}}}, "structured_outputs.json"),
    ({"extra_body": {"guided_regex": "(("}}, "guided_regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: foo"}}}, "structured_outputs.grammar"),
])
def test_invalid_formats_are_400_naming_the_clients_field(client, engine, kwargs, param):
    body = bad_request(client, **kwargs)
    assert body["param"] == param and body["message"].startswith(param), body
    assert "sampling." not in body["message"] and "start: /" not in body["message"], body
    assert engine.requests == []


def test_engine_format_errors_name_the_field_the_proxy_translated(client, engine):
    body = bad_request(client, content="!error 3 sampling.structured_output.regex", extra_body={"guided_regex": "a+"})
    assert body["param"] == "guided_regex" and "scripted error 3 for guided_regex" in body["message"]
    body = bad_request(client, content="!error 3 sampling.structured_output.lark_grammar", tools=[WEATHER],
                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert body["param"] == "tools[0].function.parameters"
    assert body["message"] == "tools[0].function.parameters cannot be used to constrain the output for this model"
    body = bad_request(client, content="!error 3 sampling.structured_output.lark_grammar", tools=[WEATHER],
                       tool_choice="required")
    assert body["param"] == "tools"
    # Errors about anything else keep the engine's field.
    body = bad_request(client, content="!error 3 stopping.max_tokens", extra_body={"guided_regex": "a+"})
    assert body["param"] == "stopping.max_tokens"


def sent_grammar(engine) -> str | None:
    so = engine.requests[-1].sampling
    return so.structured_output.lark_grammar if so.HasField("structured_output") else None


def test_strict_tool_under_auto_constrains_calls_not_text(client, engine):
    engine.script["weather?"] = "It is sunny."
    assert ask(client, tools=[WEATHER]).choices[0].message.content == "It is sunny."
    assert sent_grammar(engine) is None  # no strict tool: the output is free
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True,
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}, "days": {"type": "integer"}}}}}
    assert ask(client, tools=[strict]).choices[0].message.content == "It is sunny."
    grammar = sent_grammar(engine)
    assert grammar.startswith("start: TEXT | OPEN ")
    # OpenAI's strict mode: only the listed properties, all of them required.
    held = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "additionalProperties": False, "required": ["city", "days"]}
    [args] = [line.removeprefix("args_0: %json ") for line in grammar.splitlines() if line.startswith("args_0:")]
    args = json.loads(args)
    assert args.pop("x-guidance") == {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    assert args == held
    # The client's schema itself is what the model is shown.
    assert json.dumps(strict["function"]["parameters"]) in engine.requests[-1].chat.messages[0].content
    # A request format constrains the text instead; the strict calls are then free.
    ask(client, tools=[strict], response_format={"type": "json_object"})
    assert engine.requests[-1].sampling.structured_output.json_object


def test_strict_tool_allowing_other_properties_is_400(client, engine):
    loose = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"inner": {"type": "object", "additionalProperties": True}}}}}
    body = bad_request(client, tools=[loose])
    assert body["param"] == "tools[0].function.parameters" and "/properties/inner" in body["message"]
