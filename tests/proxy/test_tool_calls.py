"""Tool calls through the proxy, driven by the scripted engine (a 135M model does not call tools reliably)."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.proxy.fake_engine import CHATML

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TWO_CALLS = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def ask(client, content="weather?", **kw):
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": content}],
                                          tools=kw.pop("tools", [WEATHER, TIME]), **kw)


def test_non_streaming_tool_calls(client, engine):
    engine.script["weather?"] = TWO_CALLS
    resp = ask(client)
    msg, choice = resp.choices[0].message, resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert msg.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    assert len({c.id for c in msg.tool_calls}) == 2
    # SmolLM2-like template without tools: they arrive as a Hermes system prompt.
    system = engine.requests[-1].chat.messages[0]
    assert system.role == "system" and "<tools>" in system.content and "get_weather" in system.content
    assert engine.requests[-1].chat.tools_json == ""


def test_only_a_call_means_null_content(client, engine):
    engine.script["weather?"] = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    msg = ask(client).choices[0].message
    assert msg.content is None and msg.tool_calls[0].function.arguments == '{"city": "Oslo"}'


def test_streaming_tool_call_deltas_like_openai(client, engine):
    engine.script["weather?"] = TWO_CALLS
    chunks = list(ask(client, stream=True))
    content, calls = "", {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and tc.type is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
    assert content == "Checking."
    assert "<tool_call>" not in content
    assert sorted(calls) == [0, 1]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    arg_chunks = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])
                  if tc.index == 0 and tc.id is None]
    assert len(arg_chunks) > 1, "arguments stream in fragments"


def test_tool_choice_none_keeps_tools_out(client, engine):
    engine.script["weather?"] = "No tools for me."
    resp = ask(client, tool_choice="none")
    assert resp.choices[0].message.content == "No tools for me." and resp.choices[0].message.tool_calls is None
    assert all("<tools>" not in m.content for m in engine.requests[-1].chat.messages)


def test_named_tool_choice_forces_the_call(client, engine):
    engine.script["!prefilled"] = '{"city": "Rome"}}\n</tool_call>'
    resp = ask(client, content="anything", tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = resp.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Rome"}')
    chat = engine.requests[-1].chat
    assert chat.continue_final_message and chat.messages[-1].role == "assistant"
    assert chat.messages[-1].content.endswith('"name": "get_weather", "arguments": ')


def test_required_that_fails_says_so(client, engine):
    engine.script["!prefilled"] = "I refuse to call anything"
    resp = ask(client, content="x", tool_choice="required")
    msg = resp.choices[0].message
    assert msg.tool_calls is None and msg.content is None
    assert "did not produce a valid call" in msg.refusal
    assert resp.choices[0].finish_reason == "stop"


def test_named_unknown_function_is_400(client, engine):
    import openai
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert exc.value.body["param"] == "tool_choice"


def test_parallel_tool_calls_false_keeps_first(client, engine):
    engine.script["weather?"] = TWO_CALLS
    msg = ask(client, parallel_tool_calls=False).choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]


def test_history_with_tool_calls_rendered_as_text(client, engine):
    engine.script["<tool_response>\n22 C\n</tool_response>"] = "It is 22 C in Paris."
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    resp = client.chat.completions.create(model="fake-model", messages=messages, tools=[WEATHER])
    assert resp.choices[0].message.content == "It is 22 C in Paris."
    msgs = engine.requests[-1].chat.messages
    assert msgs[2].role == "assistant"
    assert msgs[2].content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert msgs[3].role == "tool" and msgs[3].content == "<tool_response>\n22 C\n</tool_response>"


def test_template_with_tools_gets_structured_messages(start_proxy, fake_server, engine):
    engine.chat_template = CHATML + "{# tools #}"
    try:
        proxy = start_proxy(engines=[fake_server.target], tool_parser="mistral")
        c = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        engine.script["go"] = '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'
        messages = [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "noon"}, {"role": "user", "content": "go"}]
        resp = c.chat.completions.create(model="fake-model", messages=messages, tools=[TIME])
        assert resp.choices[0].message.tool_calls[0].function.name == "get_time"
        chat = engine.requests[-1].chat
        assert json.loads(chat.tools_json) == [TIME]
        assert not chat.messages[0].HasField("content")
        assert [(t.id, t.name, t.arguments_json) for t in chat.messages[0].tool_calls] == [("call_9", "get_time", "{}")]
        assert chat.messages[1].tool_call_id == "call_9" and chat.messages[1].content == "noon"
    finally:
        engine.chat_template = CHATML


def test_n2_each_choice_parses_its_own_calls(client, engine):
    engine.script["weather?"] = ['<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "No call."]
    resp = ask(client, n=2)
    assert resp.choices[0].finish_reason == "tool_calls" and resp.choices[0].message.tool_calls[0].function.name == "get_time"
    assert resp.choices[1].finish_reason == "stop" and resp.choices[1].message.content == "No call."


HISTORY = [
    {"role": "user", "content": "weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
]


@pytest.mark.parametrize("offer", [{}, {"tools": []}, {"tools": [WEATHER], "tool_choice": "none"}],
                         ids=["tools-absent", "tools-empty", "tool-choice-none"])
@pytest.mark.parametrize("content", [None, ""])
def test_history_with_tool_calls_but_no_tools_offered_is_still_markup(client, engine, offer, content):
    engine.script["<tool_response>\n22 C\n</tool_response>"] = "It is 22 C in Paris."
    messages = [HISTORY[0], {**HISTORY[1], "content": content}, HISTORY[2]]
    resp = client.chat.completions.create(model="fake-model", messages=messages, **offer)
    assert resp.choices[0].message.content == "It is 22 C in Paris." and resp.choices[0].message.tool_calls is None
    msgs = engine.requests[-1].chat.messages
    assert [m.role for m in msgs] == ["user", "assistant", "tool"]  # no tools system prompt
    assert msgs[1].content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert not msgs[1].tool_calls
    assert msgs[2].content == "<tool_response>\n22 C\n</tool_response>"
