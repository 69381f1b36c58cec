"""The Responses API end to end: the official `openai` SDK's `responses.create`, `.stream` and `.parse`, the
proxy and the real engine (embedded SmolLM2, greedy). A response is held to what /v1/chat/completions
answers for the same conversation (same text, same token counts), and every object and event to the SDK's
own types, validated strictly."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from rest_proxy.config import ProxyConfig
from rest_proxy.mcp_config import load_mcp_config
from tests.proxy.servers import ProxyServer
from tests.proxy.test_mcp import stdio, write_config

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def strict(response) -> Response:
    """The response as the SDK's `Response`, validated (the SDK itself only constructs it)."""
    return Response.model_validate(response.to_dict(warnings=False))


def chat(sdk, model, messages, **kw):
    return sdk.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


def text_events(n_deltas: int) -> list[str]:
    return ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * n_deltas, "response.output_text.done", "response.content_part.done",
            "response.output_item.done"]


def test_create_matches_chat_with_instructions(sdk, model):
    resp = strict(sdk.responses.create(model=model, instructions="You are a pirate.", input="Say hello.",
                                       max_output_tokens=12, temperature=0))
    expected = chat(sdk, model, [{"role": "system", "content": "You are a pirate."},
                                 {"role": "user", "content": "Say hello."}], max_tokens=12)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == model
    assert resp.instructions == "You are a pirate." and resp.max_output_tokens == 12
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert resp.output_text == expected.choices[0].message.content and resp.output_text
    assert resp.usage.input_tokens == expected.usage.prompt_tokens  # the instructions are the system message
    assert resp.usage.output_tokens == expected.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    # The pirate talks on past 12 tokens (chat's finish_reason "length"): the response is incomplete.
    assert expected.choices[0].finish_reason == "length"
    assert (resp.status, message.status, resp.incomplete_details.reason) == \
        ("incomplete", "incomplete", "max_output_tokens")


def test_max_output_tokens_makes_it_incomplete(sdk, model):
    resp = strict(sdk.responses.create(model=model, input="Write a long story about the sea.", max_output_tokens=3,
                                       temperature=0))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.usage.output_tokens == 3
    with sdk.responses.stream(model=model, input="Write a long story about the sea.", max_output_tokens=3,
                              temperature=0) as stream:
        types = [e.type for e in stream]
    assert types[-1] == "response.incomplete" and "response.completed" not in types
    assert types[:-1] == text_events(types.count("response.output_text.delta"))


def test_previous_response_id_continues_the_conversation(sdk, model):
    first = sdk.responses.create(model=model, instructions="Answer briefly.", input="My name is Ada.",
                                 max_output_tokens=10, temperature=0)
    second = strict(sdk.responses.create(model=model, previous_response_id=first.id, input="What is my name?",
                                         max_output_tokens=10, temperature=0))
    assert second.previous_response_id == first.id
    # Instructions do not carry over; the earlier turn's input and output do.
    expected = chat(sdk, model, [{"role": "user", "content": "My name is Ada."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}], max_tokens=10)
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert sdk.responses.retrieve(second.id).output_text == second.output_text


def test_stream_events_and_final_response(sdk, model):
    kwargs = {"model": model, "input": "Name three colors.", "max_output_tokens": 16, "temperature": 0}
    created = sdk.responses.create(**kwargs)
    with sdk.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    for event in events:
        EVENTS.validate_python(event.to_dict())
    types = [e.type for e in events]
    assert created.status == "completed" and created.usage.output_tokens < 16  # the list ends in time
    assert types == [*text_events(types.count("response.output_text.delta")), "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == created.output_text
    assert strict(final).output_text == created.output_text and final.id == events[0].response.id
    assert final.usage.output_tokens == created.usage.output_tokens and final.status == "completed"
    assert sdk.responses.retrieve(final.id).output_text == created.output_text  # stored once streamed


def test_function_tool_round_trip(sdk, model):
    ask = "What is the weather in Paris?"
    forced = {"model": model, "input": ask, "tools": [WEATHER], "max_output_tokens": 30, "temperature": 0,
              "tool_choice": {"type": "function", "name": "get_weather"}}
    resp = strict(sdk.responses.create(**forced))
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert resp.tool_choice.name == "get_weather" and resp.tools[0].name == "get_weather"
    # Streamed: the same call, its arguments in deltas.
    with sdk.responses.stream(**forced) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    n = types.count("response.function_call_arguments.delta")
    assert n >= 1 and types == ["response.created", "response.in_progress", "response.output_item.added",
                                *["response.function_call_arguments.delta"] * n,
                                "response.function_call_arguments.done", "response.output_item.done",
                                "response.completed"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == final.output[0].arguments == call.arguments
    # The result goes back by previous_response_id, or with the whole conversation as input: the same answer,
    # and the one chat gives for the same history.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 degrees Celsius."}
    by_id = sdk.responses.create(model=model, previous_response_id=resp.id, input=[result], max_output_tokens=12,
                                 temperature=0)
    stateless = sdk.responses.create(model=model, input=[{"role": "user", "content": ask}, call.to_dict(), result],
                                     store=False, max_output_tokens=12, temperature=0)
    expected = chat(sdk, model, [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 22 degrees Celsius."}], max_tokens=12)
    assert by_id.output_text == stateless.output_text == expected.choices[0].message.content
    assert by_id.usage.input_tokens == stateless.usage.input_tokens == expected.usage.prompt_tokens
    with pytest.raises(Exception) as err:  # store: false keeps nothing
        sdk.responses.retrieve(stateless.id)
    assert err.value.status_code == 404


class Weather(BaseModel):
    city: str
    sunny: bool


def test_text_format_json_schema(sdk, model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London"]},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    resp = strict(sdk.responses.create(model=model, input="The weather in Paris, as JSON.", max_output_tokens=40,
                                       temperature=0, text={"format": {"type": "json_schema", "name": "weather",
                                                                       "schema": schema, "strict": True}}))
    assert resp.status == "completed" and resp.text.format.type == "json_schema"
    jsonschema.validate(json.loads(resp.output_text), schema)
    # The SDK's own structured-output helper, streamed and not.
    parsed = sdk.responses.parse(model=model, input="The weather in London, as JSON.", text_format=Weather,
                                 max_output_tokens=40, temperature=0)
    assert isinstance(parsed.output_parsed, Weather)
    with sdk.responses.stream(model=model, input="The weather in London, as JSON.", text_format=Weather,
                              max_output_tokens=40, temperature=0) as stream:
        assert stream.get_final_response().output_parsed == parsed.output_parsed


def test_mcp_tool_runs_in_the_proxy(real_engine, model, tmp_path):
    # The forced call goes to the MCP server through the proxy; the last round answers from its result.
    path = write_config(tmp_path, {"calc": stdio(timeout=10)})
    proxy = ProxyServer(ProxyConfig(engines=[real_engine], mcp_servers=load_mcp_config(path),
                                    max_mcp_rounds=2)).start()
    try:
        client = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kwargs = {"model": model, "input": "What is 2 plus 3? Use the tool.", "max_output_tokens": 40,
                  "temperature": 0, "tool_choice": {"type": "function", "name": "calc__add"}}
        resp = strict(client.responses.create(**kwargs))
        assert [item.type for item in resp.output] == ["mcp_call", "message"] and resp.output_text
        call = resp.output[0]
        arguments = json.loads(call.arguments)
        assert (call.server_label, call.name, call.status, call.error) == ("calc", "add", "completed", None)
        assert call.output == str(arguments["a"] + arguments["b"])  # what the server computed
        with client.responses.stream(**kwargs) as stream:
            types = [event.type for event in stream]
            final = stream.get_final_response()
        assert final.output_text == resp.output_text and final.output[0].output == call.output
        start = types.index("response.mcp_call.in_progress")
        assert types[start - 1:start + 5] == [
            "response.output_item.added", "response.mcp_call.in_progress", "response.mcp_call_arguments.delta",
            "response.mcp_call_arguments.done", "response.mcp_call.completed", "response.output_item.done"]
        # A follow-up reads the call and its result from the stored response.
        follow = client.responses.create(model=model, input="Say it again.", previous_response_id=resp.id,
                                         max_output_tokens=8, temperature=0)
        assert follow.status in ("completed", "incomplete")
        metrics = httpx.get(proxy.url + "/metrics").text
        assert 'rest_proxy_mcp_tool_calls_total{outcome="ok",server="calc",tool="add"} 2.0' in metrics
    finally:
        proxy.stop()


def post(proxy, body) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/responses", json=body, timeout=60)


@pytest.mark.parametrize("body, status, param", [
    ({"previous_response_id": "resp_missing", "input": "hi"}, 404, "previous_response_id"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "web_search_call", "id": "ws_1"}]}, 400, "input[1].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, 400, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
    ({"input": "hi", "tool_choice": {"type": "mcp", "server_label": "x"}}, 400, "tool_choice"),
    ({"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "nonsense"}}]}, 400, "tools[0].parameters"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}}, 400,
     "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, 400, "temperature"),
], ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.parametrize("stream", [False, True])
def test_errors_name_the_field(real_proxy, model, body, status, param, stream):
    resp = post(real_proxy, {"model": model, **body, "stream": stream})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param.split("[")[0].split(".")[0] in error["message"] or status == 404


def test_unknown_response_ids(sdk, real_proxy):
    for method in ("GET", "DELETE"):
        resp = httpx.request(method, real_proxy.url + "/v1/responses/resp_missing", timeout=10)
        assert resp.status_code == 404
        assert resp.json()["error"]["param"] == "response_id"
        assert resp.json()["error"]["code"] == "response_not_found"
