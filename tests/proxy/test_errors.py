"""Errors in OpenAI's shape with the right status, as the SDK sees them; auth; cancellation."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from openai import OpenAI

from tests.proxy.fake_engine import free_port
from tests.waiting import wait_for


def _chat(client, content, **kw):
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": content}], **kw)


@pytest.mark.parametrize("code,cls,status,param", [
    (3, openai.BadRequestError, 400, "sampling.top_p"),
    (8, openai.RateLimitError, 429, None),
    (14, openai.InternalServerError, 503, None),
    (4, openai.APITimeoutError if False else openai.InternalServerError, 504, None),
    (12, openai.BadRequestError, 400, None),
])
def test_inband_engine_errors(client, engine, code, cls, status, param):
    field = param or ""
    with pytest.raises(cls) as exc:
        _chat(client, f"!error {code} {field}".strip())
    assert exc.value.status_code == status
    body = exc.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == param
    assert "9000" in body["message"] and "2048" in body["message"]


def test_inband_error_in_stream_is_http_error(client, engine):
    with pytest.raises(openai.BadRequestError) as exc:
        list(_chat(client, "!error 3 stopping.max_tokens", stream=True))
    assert exc.value.body["param"] == "stopping.max_tokens"
    assert exc.value.body["type"] == "invalid_request_error"


def test_call_status_errors(client, engine):
    with pytest.raises(openai.RateLimitError):
        _chat(client, "!status RESOURCE_EXHAUSTED")
    with pytest.raises(openai.InternalServerError) as exc:
        _chat(client, "!status DEADLINE_EXCEEDED")
    assert exc.value.status_code == 504


def test_deadline_from_request_timeout(start_proxy, fake_server, engine):
    proxy = start_proxy(engines=[fake_server.target], request_timeout=0.5)
    c = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as exc:
        _chat(c, "!hang")
    assert exc.value.status_code == 504 and exc.value.body["code"] == "deadline_exceeded"


def test_validation_errors_are_400_with_param(client, proxy, engine):
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, "x", temperature=5)
    assert exc.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="fake-model", messages=[{"role": "wizard", "content": "x"}])
    assert exc.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, "x", max_tokens=100000)
    assert "100000" in exc.value.body["message"] and "2048" in exc.value.body["message"]
    r = httpx.post(proxy.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    raw = b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud800"}]}'
    r = httpx.post(proxy.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "Unicode" in r.json()["error"]["message"]


def test_unknown_model_is_404(client, engine):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"


def test_unreachable_engine_is_503(start_proxy):
    proxy = start_proxy(engines=[f"127.0.0.1:{free_port()}"])
    c = OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as exc:
        _chat(c, "x")
    assert exc.value.status_code == 503 and exc.value.body["code"] == "engine_unavailable"
    assert httpx.get(proxy.url + "/health").status_code == 503


def test_api_key(start_proxy, fake_server, engine):
    proxy = start_proxy(engines=[fake_server.target], api_key="sekret")
    bad = OpenAI(base_url=proxy.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        _chat(bad, "x")
    assert exc.value.body["code"] == "invalid_api_key"
    assert httpx.post(proxy.url + "/v1/chat/completions", json={}).status_code == 401
    assert httpx.post(proxy.url + "/tokenize", json={"model": "fake-model", "prompt": "a"}).status_code == 401
    assert httpx.post(proxy.url + "/detokenize", json={"model": "fake-model", "tokens": [97]}).status_code == 401
    for path in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        assert httpx.post(proxy.url + path, json={"model": "fake-model"}).status_code == 401, path
    assert httpx.get(proxy.url + "/health").status_code == 200
    assert httpx.get(proxy.url + "/metrics").status_code == 200
    good = OpenAI(base_url=proxy.url + "/v1", api_key="sekret", max_retries=0)
    assert _chat(good, "x").choices[0].message.content


def test_client_disconnect_cancels_engine_request(proxy, engine):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "!slow"}], "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not engine.aborted_calls:
        time.sleep(0.05)
    assert engine.aborted_calls == 1  # the call was cancelled, which aborts the engine request
    wait_for(lambda: "rest_proxy_sse_streams_open 0.0" in httpx.get(proxy.url + "/metrics").text, 5,
             "the stream's gauge to drop")


def test_disconnect_while_engine_is_silent(proxy, engine):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "!hang"}], "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not engine.aborted_calls:
        time.sleep(0.05)
    assert engine.aborted_calls == 1


def test_grpc_error_metrics(proxy, client, engine):
    with pytest.raises(openai.RateLimitError):
        _chat(client, "!error 8")
    text = httpx.get(proxy.url + "/metrics").text
    assert 'rest_proxy_grpc_errors_total{code="RESOURCE_EXHAUSTED"}' in text
