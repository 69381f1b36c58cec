"""Chat completions through the proxy and the scripted engine, with the official SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from inference_service.api import pb


def test_chat_basic(client, engine):
    engine.script["hi"] = "Hello there, friend."
    resp = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=50, temperature=0.0)
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    assert resp.system_fingerprint.startswith("fp_")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == "Hello there, friend."
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == 7
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    assert resp.usage.prompt_tokens_details.cached_tokens == 3
    start = engine.requests[-1]
    assert start.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in start.chat.messages] == [("user", "hi")]
    assert start.sampling.temperature == 0.0
    assert start.stopping.max_tokens == 50
    assert start.chat.tools_json == ""


def test_sampling_fields_reach_the_engine(client, engine):
    client.chat.completions.create(
        model="fake-model", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "x"}],
        max_completion_tokens=9, top_p=0.5, seed=-1, frequency_penalty=0.5, presence_penalty=-0.5,
        logit_bias={"42": 5.0}, stop="END", user="someone", n=1,
        extra_body={"top_k": 7, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
                    "unknown_field": {"ignored": True}})
    s = engine.requests[-1]
    assert s.stopping.max_tokens == 9 and list(s.stopping.stop) == ["END"]
    assert s.stopping.min_tokens == 2 and s.stopping.ignore_eos
    assert s.sampling.top_p == 0.5 and s.sampling.top_k == 7
    assert s.sampling.min_p == pytest.approx(0.1) and s.sampling.repetition_penalty == pytest.approx(1.1)
    assert s.sampling.seed == 2**64 - 1
    assert s.sampling.frequency_penalty == 0.5 and s.sampling.presence_penalty == -0.5
    assert dict(s.sampling.logit_bias) == {42: 5.0}
    assert not s.sampling.HasField("temperature")


def test_n_and_stop_and_length(client, engine):
    engine.script["two"] = ["first answer END more", "second answer is long"]
    resp = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "two"}],
                                          n=2, stop=["END"], max_tokens=5)
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].message.content == "first answer "
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[1].message.content == "second answer i"
    assert resp.choices[1].finish_reason == "length"
    assert engine.requests[-1].n == 2


def test_streaming_matches_non_streaming(client, engine):
    engine.script["s"] = "Streaming is fun to watch."
    chunks = list(client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "s"}], stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streaming is fun to watch."
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_raw_sse_ends_with_done(proxy, engine):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert "usage" not in json.loads(lines[0][6:])


def test_logprobs(client, engine):
    engine.script["lp"] = "abcdef"
    resp = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "lp"}],
                                          logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert [t.token for t in content] == ["abc", "def"]
    assert content[0].logprob == -0.5 and content[0].bytes == list(b"abc")
    assert [t.token for t in content[0].top_logprobs] == ["abc", "abc1"]
    assert engine.requests[-1].sampling.logprobs and engine.requests[-1].sampling.top_logprobs == 2
    chunks = list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "lp"}],
                                                 logprobs=True, top_logprobs=1, stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == ["abc", "def"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "lp"}],
                                       top_logprobs=2)
    assert exc.value.body["param"] == "top_logprobs" and "logprobs" in exc.value.body["message"]


def test_content_parts_and_roles(client, engine):
    client.chat.completions.create(model="fake-model", messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    msgs = engine.requests[-1].chat.messages
    assert [(m.role, m.content) for m in msgs] == [("system", "be brief"), ("user", "ab")]


def test_models_and_model_card(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert client.models.retrieve("fake-model").id == "fake-model"


def test_tokenize_detokenize(proxy, engine):
    r = httpx.post(proxy.url + "/tokenize", json={"model": "fake-model", "prompt": "hey"})
    assert r.status_code == 200 and r.json()["tokens"] == [104, 101, 121] and r.json()["count"] == 3
    r = httpx.post(proxy.url + "/detokenize", json={"model": "fake-model", "tokens": [104, 105]})
    assert r.json() == {"prompt": "hi"}
    r = httpx.post(proxy.url + "/tokenize", json={"model": "fake-model", "messages": [{"role": "user", "content": "q"}]})
    assert r.json()["count"] == len("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")


def test_health_and_metrics(proxy, client, engine):
    r = httpx.get(proxy.url + "/health?detail=true")
    assert r.status_code == 200 and r.json()["engines"][0]["serving"] is True
    client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "m"}])
    text = httpx.get(proxy.url + "/metrics").text
    assert 'rest_proxy_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert "rest_proxy_http_request_duration_seconds_bucket" in text
    assert "rest_proxy_sse_streams_open 0.0" in text


def test_completions(client, engine):
    engine.script["Once upon"] = " a time there was"
    resp = client.completions.create(model="fake-model", prompt="Once upon", max_tokens=3, echo=True, logprobs=1)
    assert resp.choices[0].text == "Once upon a time t"
    assert resp.choices[0].finish_reason == "length"
    # With echo the logprobs score the prompt too: its tokens (the fake tokenizes it by character), the first
    # without a logprob, then the completion's, at their offsets in the text.
    assert resp.choices[0].logprobs.tokens == [*"Once upon", " a ", "tim", "e t"]
    assert resp.choices[0].logprobs.token_logprobs[:3] == [None, -0.5, -1.5]
    assert resp.choices[0].logprobs.top_logprobs[:2] == [None, {"n": -0.5}]
    assert resp.choices[0].logprobs.text_offset == [*range(9), 9, 12, 15]
    assert engine.requests[-1].sampling.prompt_logprobs == 1
    assert engine.requests[-1].text == "Once upon"
    resp = client.completions.create(model="fake-model", prompt=["p1", "p2"], n=2, max_tokens=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 8
    chunks = list(client.completions.create(model="fake-model", prompt=[1, 2], stream=True, max_tokens=16,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello from the fake engine."
    assert list(engine.requests[-1].token_ids.ids) == [1, 2]
    assert chunks[-1].usage.completion_tokens == 9


def test_embeddings_unimplemented_is_400(client, engine):
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model="fake-model", input="x")
    assert exc.value.code == "unsupported"


def test_embeddings(start_proxy, fake_server, engine):
    from openai import OpenAI
    engine.supports_embed = True
    try:
        proxy = start_proxy(engines=[fake_server.target])
        c = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        resp = c.embeddings.create(model="fake-model", input=["ab", "abc"], dimensions=2)
        assert [d.embedding for d in resp.data] == [[2.0, 3.0], [3.0, 4.0]]
        assert resp.usage.prompt_tokens == 5
        resp = c.embeddings.create(model="fake-model", input="ab", encoding_format="base64")
        import base64

        import numpy as np
        values = np.frombuffer(base64.b64decode(resp.data[0].embedding), dtype="<f4").tolist()
        assert values == [2.0, 3.0, 4.0, 5.0]
    finally:
        engine.supports_embed = False


def test_unknown_fields_ignored_and_finish_reason_enum(proxy, engine):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi", "extra": 1}], "foo": "bar"}
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert engine.requests[-1].WhichOneof("input") == "chat"
    assert pb.FINISH_REASON_STOP == 1
