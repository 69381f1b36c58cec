"""Tool calls end to end with the official `openai` SDK, the proxy and the real engine (embedded SmolLM2):
a tool round trip answered with no tools offered, an MCP run that reaches --max-mcp-rounds, and a
`strict` tool's calls held to its schema under `auto`."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from rest_proxy.config import ProxyConfig
from rest_proxy.mcp_config import load_mcp_config
from tests.proxy.servers import ProxyServer
from tests.proxy.test_mcp import stdio, write_config

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def round_trip(sdk, model) -> list[dict]:
    """A real tool round trip: the model's (forced) call, then the tool's result."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = sdk.chat.completions.create(model=model, messages=ask, tools=[WEATHER], tool_choice=FORCE_WEATHER,
                                       max_tokens=30, temperature=0).choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    return [*ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 degrees Celsius."}]


@pytest.mark.parametrize("offer", [{}, {"tools": []}, {"tools": [WEATHER], "tool_choice": "none"}],
                         ids=["tools-absent", "tools-empty", "tool-choice-none"])
def test_tool_history_is_answered_with_no_tools_offered(sdk, model, real_proxy, round_trip, offer):
    resp = sdk.chat.completions.create(model=model, messages=round_trip, max_tokens=12, temperature=0, **offer)
    choice = resp.choices[0]
    assert choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    # The prompt is the history with the call and its result in the model's markup (no tools prompt).
    rendered = httpx.post(real_proxy.url + "/tokenize", json={"model": model, "messages": round_trip},
                          timeout=60).json()
    assert resp.usage.prompt_tokens == rendered["count"]
    prompt = "".join(rendered["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")
    call = round_trip[1]["tool_calls"][0]["function"]
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call["arguments"]}}}\n</tool_call>' in prompt
    assert "<tool_response>\nSunny, 22 degrees Celsius.\n</tool_response>" in prompt
    assert "<tools>" not in prompt


def test_mcp_run_at_max_rounds_returns_the_answer(real_engine, model, tmp_path):
    # Two rounds: the first forces a call to the MCP tool, which the proxy runs; the second (the last) offers
    # no tools, so the model has to answer from the history that holds the call and its result.
    path = write_config(tmp_path, {"calc": stdio(timeout=10)})
    proxy = ProxyServer(ProxyConfig(engines=[real_engine], mcp_servers=load_mcp_config(path),
                                    max_mcp_rounds=2)).start()
    try:
        client = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=120)
        resp = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is 2 plus 3? Use the tool."}],
            tool_choice={"type": "function", "function": {"name": "calc__add"}}, max_tokens=40, temperature=0)
        choice = resp.choices[0]
        assert choice.message.content and choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")
        metrics = httpx.get(proxy.url + "/metrics").text
        assert 'rest_proxy_mcp_tool_calls_total{outcome="ok",server="calc",tool="add"} 1.0' in metrics
    finally:
        proxy.stop()


STRICT = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
STRICT_SCHEMA = {**WEATHER["function"]["parameters"], "additionalProperties": False}
CALL_PROMPT = [{"role": "user", "content": "<tool_call> weather Paris"}]  # SmolLM2 opens a call after this


def test_strict_tool_calls_under_auto_follow_the_schema(sdk, model):
    # (Unconstrained, the model answers this with a call to a tool it invents, keys running on to max_tokens.)
    greedy = sdk.chat.completions.create(model=model, messages=CALL_PROMPT, tools=[STRICT], max_tokens=60,
                                         temperature=0, parallel_tool_calls=False).choices[0]
    assert greedy.finish_reason == "tool_calls" and greedy.message.content is None
    [call] = greedy.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), STRICT_SCHEMA)
    # Streamed, the same call.
    chunks = list(sdk.chat.completions.create(model=model, messages=CALL_PROMPT, tools=[STRICT], max_tokens=60,
                                              temperature=0, parallel_tool_calls=False, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    # Sampled: whatever the model writes, any call it makes is valid and ends the output.
    for seed in range(3):
        choice = sdk.chat.completions.create(model=model, messages=CALL_PROMPT, tools=[STRICT], max_tokens=40,
                                             temperature=1.0, seed=seed, parallel_tool_calls=False).choices[0]
        for call in choice.message.tool_calls or []:
            assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls", choice
            jsonschema.validate(json.loads(call.function.arguments), STRICT_SCHEMA)
    # Words stay free: a question the model answers in text is answered in text.
    text = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                       tools=[STRICT], max_tokens=8, temperature=0).choices[0]
    assert text.message.content and text.message.tool_calls is None
