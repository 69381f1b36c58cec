"""Malformed and oversized inputs at both layers get INVALID_ARGUMENT / 4xx, never INTERNAL / 5xx,
and the servers keep serving. (Schema-driven fuzzing of the proxy is tests/proxy/test_schemathesis.py;
this covers what it does not generate: broken bytes, sizes past the limits, values at the edges.)"""

from __future__ import annotations

import math

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_service.api import pb, pb_grpc
from tests.grpc_client import GenerateStream

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
SERVICE = "/inference.v1.InferenceService/"


def _raw(channel, method: str, stream: bool = True):
    make = channel.stream_stream if stream else channel.unary_unary
    return make(SERVICE + method, request_serializer=lambda b: b, response_deserializer=lambda b: b)


@pytest.fixture
def channel(small_engine):
    with grpc.insecure_channel(small_engine.target) as ch:
        yield ch
    # Whatever was sent, the engine is still up and serving.
    assert small_engine.process.poll() is None
    with grpc.insecure_channel(small_engine.target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("method, stream", [("Generate", True), ("Tokenize", True), ("GetModelInfo", False)])
@pytest.mark.parametrize("data", [b"\x0a\xff\xff\xff\x0f", b"\xff" * 16, b"\x0a\x05abc"], ids=["varint", "ff", "short"])
def test_undecodable_protobuf_is_invalid_argument(channel, method, stream, data):
    call = _raw(channel, method, stream)
    with pytest.raises(grpc.RpcError) as e:
        list(call(iter([data]), timeout=10)) if stream else call(data, timeout=10)
    assert e.value.code() == INVALID_ARGUMENT, e.value.details()


def test_message_over_the_size_limit_is_refused_by_grpc(channel):
    big = pb.GenerateRequest(start=pb.StartGeneration(request_id="big", text="x" * (2 * 2**20)))  # limit 1 MiB
    with pytest.raises(grpc.RpcError) as e:
        list(_raw(channel, "Generate")(iter([big.SerializeToString()]), timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # gRPC's own answer to an oversized message


EDGE_STARTS = {
    "huge-prompt": {"token_ids": pb.TokenIds(ids=[1000] * 200_000)},  # ~600 KB, under the message limit
    "n-max": {"text": "hi", "n": 2**32 - 1},
    "max-tokens-max": {"text": "hi", "stopping": pb.StoppingCriteria(max_tokens=2**32 - 1)},
    "top-logprobs-max": {"text": "hi", "sampling": pb.SamplingParams(logprobs=True, top_logprobs=2**32 - 1)},
    "temperature-nan": {"text": "hi", "sampling": pb.SamplingParams(temperature=math.nan)},
    "temperature-inf": {"text": "hi", "sampling": pb.SamplingParams(temperature=math.inf)},
    "top-p-nan": {"text": "hi", "sampling": pb.SamplingParams(top_p=math.nan)},
    "min-p-nan": {"text": "hi", "sampling": pb.SamplingParams(min_p=math.nan)},
    "penalty-inf": {"text": "hi", "sampling": pb.SamplingParams(frequency_penalty=math.inf)},
    "logit-bias-bad-token": {"text": "hi", "sampling": pb.SamplingParams(logit_bias={2**32 - 1: 1.0})},
    "logit-bias-inf": {"text": "hi", "sampling": pb.SamplingParams(logit_bias={5: math.inf})},
    "stop-token-out-of-vocab": {"text": "hi", "stopping": pb.StoppingCriteria(stop_token_ids=[2**32 - 1])},
    "template-kwargs-not-json": {"chat": pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")],
                                                chat_template_kwargs_json="[1, 2")},
}


@pytest.mark.parametrize("name", EDGE_STARTS)
def test_edge_values_are_invalid_argument_in_band(channel, name):
    stream = GenerateStream(pb_grpc.InferenceServiceStub(channel), timeout=30)
    stream.start(name, **EDGE_STARTS[name])
    stream.wait_done({name})
    stream.drain()
    error = stream.results[name].error
    assert error is not None and error.code == INVALID_ARGUMENT.value[0], stream.results[name]
    assert error.message and error.field


def test_wire_type_mismatch_is_an_unknown_field_answered_in_band(channel):
    # Field 1 (`start`, a message) sent as a varint parses as an unknown field: a message with no action.
    (raw,) = list(_raw(channel, "Generate")(iter([b"\x08\x01"]), timeout=10))
    error = pb.GenerateResponse.FromString(raw).error
    assert error.code == INVALID_ARGUMENT.value[0] and error.field == "action"


@pytest.fixture
def post(small_proxy):
    model = httpx.get(small_proxy.url + "/v1/models").json()["data"][0]["id"]
    with httpx.Client(base_url=small_proxy.url, timeout=30) as client:
        def post(path: str, *, json=None, content=None, headers=None) -> httpx.Response:
            if json is not None and "model" not in json:
                json = {"model": model, **json}
            return client.post(path, json=json, content=content, headers=headers)
        yield post
    assert httpx.get(small_proxy.url + "/health", timeout=5).status_code == 200


HTTP_CASES = {
    "not-json": {"content": b"{not json", "headers": {"content-type": "application/json"}},
    "invalid-utf8": {"content": b'{"prompt": "\xff\xfe", "model": "m"}',
                     "headers": {"content-type": "application/json"}},
    "json-array": {"content": b"[1, 2, 3]", "headers": {"content-type": "application/json"}},
    "deep-nesting": {"content": b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
                     "headers": {"content-type": "application/json"}},
    "huge-prompt": {"json": {"prompt": [1000] * 300_000, "max_tokens": 4}},
    "huge-text-prompt": {"json": {"prompt": "word " * 400_000, "max_tokens": 4}},
    "max-tokens-huge": {"json": {"prompt": "hi", "max_tokens": 10**30}},
    "n-huge": {"json": {"prompt": "hi", "n": 2**40}},
    "token-out-of-vocab": {"json": {"prompt": [1, 10**9], "max_tokens": 4}},
    "temperature-string": {"json": {"prompt": "hi", "temperature": "hot"}},
    "nan-temperature": {"content": b'{"model": "m", "prompt": "hi", "temperature": NaN}',
                        "headers": {"content-type": "application/json"}},
    "bad-role-enum": {"path": "/v1/chat/completions", "json": {"messages": [{"role": "robot", "content": "x"}]}},
    "bad-tool-choice-enum": {"path": "/v1/chat/completions",
                             "json": {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}},
    "bad-encoding-format-enum": {"path": "/v1/embeddings", "json": {"input": "x", "encoding_format": "xml"}},
}


@pytest.mark.parametrize("name", HTTP_CASES)
def test_proxy_answers_4xx_to_malformed_requests(post, name):
    case = dict(HTTP_CASES[name])
    response = post(case.pop("path", "/v1/completions"), **case)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert response.json()["error"]["type"]
    if name == "huge-text-prompt":  # 2 MB over the engine's 1 MiB message limit: too large, not "retry later"
        assert response.status_code == 413, response.text[:300]
