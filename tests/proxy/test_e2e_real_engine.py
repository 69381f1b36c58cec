"""The official `openai` SDK against the proxy in front of the real engine with the embedded SmolLM2.

Generation runs on CPU (~30 tok/s), so every request keeps `max_tokens` small.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import openai
import pytest
from openai import OpenAI

from rest_proxy.config import ProxyConfig
from tests.proxy.fake_engine import free_port
from tests.proxy.servers import ProxyServer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


@pytest.fixture(scope="session")
def greedy(sdk, model):
    return sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0)


def test_chat(greedy):
    assert "Paris" in greedy.choices[0].message.content
    assert greedy.choices[0].finish_reason in ("stop", "length")
    assert 0 < greedy.usage.completion_tokens <= 10 and greedy.usage.prompt_tokens > 5
    assert greedy.id.startswith("chatcmpl-") and greedy.system_fingerprint.startswith("fp_")


def test_streaming_equals_non_streaming_with_usage(sdk, model, greedy):
    chunks = list(sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == greedy.usage.prompt_tokens


def test_completions_and_n2(sdk, model):
    resp = sdk.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert resp.choices[0].text and resp.choices[0].finish_reason in ("stop", "length")
    resp = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, n=2, temperature=1.0, seed=7)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.message.content for c in resp.choices)
    assert resp.usage.completion_tokens <= 12


def test_stop(sdk, model, greedy):
    text = greedy.choices[0].message.content
    stop = "Paris"
    resp = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0, stop=[stop])
    assert resp.choices[0].message.content == text[:text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_logprobs(sdk, model):
    resp = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert bytes(t.bytes).decode() == t.token
        assert t.token == t.top_logprobs[0].token  # greedy picks the most likely


def test_seed_reproducibility(sdk, model):
    def run(seed):
        return sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=1.0,
                                           seed=seed).choices[0].message.content
    assert run(1234) == run(1234)


def test_errors_map_to_sdk_exceptions(sdk, model, real_engine, real_proxy):
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, top_p=0.0)
    assert exc.value.body["param"] == "sampling.top_p"
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.completions.create(model=model, prompt="hello " * 9000, max_tokens=2)
    assert "8192" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=ProxyServer.url.fget(_auth_proxy(real_engine)) + "/v1", api_key="bad", max_retries=0) \
            .chat.completions.create(model=model, messages=QUESTION, max_tokens=2)


_extra: list[ProxyServer] = []


def _auth_proxy(target):
    server = ProxyServer(ProxyConfig(engines=[target], api_key="good")).start()
    _extra.append(server)
    return server


@pytest.fixture(scope="session", autouse=True)
def _stop_extra():
    yield
    for server in _extra:
        server.stop()


def test_embeddings(sdk, model):
    # The engine serves embeddings next to the generative model (the UNIMPLEMENTED -> 400 mapping is
    # covered with the scripted engine).
    resp = sdk.embeddings.create(model=model, input=["Paris is in France.", "Berlin"])
    assert [d.index for d in resp.data] == [0, 1]
    assert len(resp.data[0].embedding) == len(resp.data[1].embedding) > 0
    assert resp.usage.prompt_tokens > 0


def test_deadline_is_504_and_unreachable_is_503(real_engine, model):
    slow = ProxyServer(ProxyConfig(engines=[real_engine], request_timeout=0.01)).start()
    dead = ProxyServer(ProxyConfig(engines=[f"127.0.0.1:{free_port()}"])).start()
    try:
        with pytest.raises(openai.InternalServerError) as exc:
            OpenAI(base_url=slow.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                model=model, messages=QUESTION, max_tokens=16)
        assert exc.value.status_code == 504
        with pytest.raises(openai.InternalServerError) as exc:
            OpenAI(base_url=dead.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
                model=model, messages=QUESTION, max_tokens=2)
        assert exc.value.status_code == 503
    finally:
        slow.stop()
        dead.stop()


def test_engine_queue_full_is_429(sdk, model):
    def one(_):
        try:
            sdk.completions.create(model=model, prompt="Hi", max_tokens=1)
            return "ok"
        except openai.RateLimitError:
            return "429"
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            results = list(pool.map(one, range(12)))
        if "429" in results:
            break
    assert "429" in results and "ok" in results


def test_smollm2_gets_the_hermes_parser(real_proxy):
    # SmolLM2 is family "llama", but its chat template is ChatML: it writes <tool_call> blocks.
    client = real_proxy.app.state.router.clients[0]
    assert client.info.family == "llama" and "<|im_start|>" in client.info.chat_template
    assert "tools" not in client.info.chat_template  # so the tools go into a system prompt
    from rest_proxy.tool_parsers import select_parser
    assert select_parser(client.info.family, client.info.chat_template).name == "hermes"


def test_forced_tool_call_through_real_engine(sdk, model):
    resp = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[WEATHER], max_tokens=30, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = resp.choices[0]
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    # The arguments are constrained to the tool's schema and the call ends the output.
    assert choice.finish_reason == "tool_calls"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    assert choice.message.content is None
    chunks = list(sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER], max_tokens=30,
        temperature=0, stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object(sdk, model):
    import jsonschema

    resp = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Invent a person. Reply in JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(resp.choices[0].message.content), PERSON)
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Return a JSON object with the keys city and country for Paris."}],
        max_tokens=60,
        temperature=0, response_format={"type": "json_object"}, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict), text


def test_vllm_guided_fields_on_completions(sdk, model):
    resp = sdk.completions.create(model=model, prompt="Is water wet? Answer:", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no", "it depends"]})
    assert resp.choices[0].text in ("yes", "no", "it depends")
    resp = sdk.completions.create(model=model, prompt="A phone number:", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", resp.choices[0].text), resp.choices[0].text
    resp = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}})
    assert resp.choices[0].message.content in ("Paris", "Lyon")
    odd = ['say "hi"', "café", "back\\slash"]  # quotes, non-ASCII and a backslash reach the grammar intact
    texts = {sdk.completions.create(model=model, prompt="Pick one:", max_tokens=8, temperature=1.0, seed=seed,
                                    extra_body={"guided_choice": odd}).choices[0].text for seed in range(6)}
    assert texts <= set(odd) and texts, texts


def test_bad_formats_are_400_naming_the_field(sdk, model):
    cases = [({"extra_body": {"guided_regex": "(("}}, "guided_regex"),
             ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
             ({"extra_body": {"structured_outputs": {"regex": "a", "grammar": "start: \"a\""}}},
              "structured_outputs.grammar"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
              "response_format.json_schema.schema")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=5, **kwargs)
        assert exc.value.body["param"] == param, exc.value.body


def test_forced_calls_follow_the_tool_schemas(sdk, model):
    import jsonschema

    convert = {"type": "function", "function": {"name": "convert", "parameters": {
        "type": "object", "properties": {"amount": {"type": "number"},
                                         "unit": {"enum": ["celsius", "fahrenheit", "kelvin"]}},
        "required": ["amount", "unit"], "additionalProperties": False}}}
    for seed in range(3):
        resp = sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Convert 20 degrees."}], tools=[convert, WEATHER],
            tool_choice={"type": "function", "function": {"name": "convert"}}, max_tokens=40, temperature=1.0,
            seed=seed)
        call = resp.choices[0].message.tool_calls[0]
        assert call.function.name == "convert" and resp.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), convert["function"]["parameters"])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (convert, WEATHER)}
    for seed in range(3):  # "required": any of the tools, each call valid for its own schema
        resp = sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather in Oslo, and convert 20 degrees."}],
            tools=[convert, WEATHER], tool_choice="required", max_tokens=80, temperature=1.0, seed=seed,
            parallel_tool_calls=False)
        assert resp.choices[0].finish_reason == "tool_calls" and len(resp.choices[0].message.tool_calls) == 1
        for call in resp.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    resp = sdk.chat.completions.create(  # parallel calls allowed: the model ends them itself
        model=model, messages=[{"role": "user", "content": "Weather in Oslo, and convert 20 degrees."}],
        tools=[convert, WEATHER], tool_choice="required", max_tokens=120, temperature=0)
    assert resp.choices[0].finish_reason == "tool_calls", resp.choices[0]
    for call in resp.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model=model, messages=QUESTION, tools=[convert], max_tokens=5,
                                    tool_choice={"type": "function", "function": {"name": "convert"}},
                                    response_format={"type": "json_object"})
    assert exc.value.body["param"] == "tool_choice"
