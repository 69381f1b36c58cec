"""The engine end to end over gRPC on loopback: a real server process and a real client."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from inference_service.api import pb, pb_grpc
from tests.grpc_client import GenerateStream, greedy, kv_cache_usage, start_engine

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
CHAT = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = start_engine("--max-model-len", "2048", "--kv-cache-memory", "256", log_path=str(log))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stub(engine):
    with grpc.insecure_channel(engine.target) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def generate_alone(stub, **fields) -> list[int]:
    stream = GenerateStream(stub)
    stream.start("solo", **fields)
    stream.wait_done({"solo"})
    stream.close()
    return stream.results["solo"].tokens


def test_chat_answers_and_reports_usage(stub):
    stream = GenerateStream(stub)
    stream.start("q", chat=CHAT, **greedy(16))
    stream.wait_done({"q"})
    result = stream.results["q"]
    assert "Paris" in result.text
    assert result.completions[0].finish_reason == pb.FINISH_REASON_STOP
    assert result.usage.completion_tokens == len(result.tokens)
    assert result.usage.prompt_tokens > 10
    stream.drain()


def test_multiplexed_stream_matches_single_requests(stub):
    prompts = {"a": "The quick brown fox", "b": "def fibonacci(n):", "c": "Once upon a time"}
    alone = {rid: generate_alone(stub, text=text, **greedy(12)) for rid, text in prompts.items()}
    stream = GenerateStream(stub)
    for rid, text in prompts.items():
        stream.start(rid, text=text, **greedy(12))
    stream.drain()
    for rid in prompts:
        assert stream.results[rid].tokens == alone[rid]
        assert stream.results[rid].usage.completion_tokens == 12
        assert stream.results[rid].completions[0].finish_reason == pb.FINISH_REASON_LENGTH
    # Responses of different requests interleave on the stream (one message per token each).
    assert all(stream.results[rid].num_messages >= 12 for rid in prompts)


def test_cancel_aborts_and_frees_blocks(stub, engine):
    stream = GenerateStream(stub)
    stream.start("long", text="Count from one to a thousand:", **greedy(1000, ignore_eos=True))
    stream.start("short", text="Hello", **greedy(4))
    while len(stream.results["long"].tokens) < 2:
        stream.next()
    stream.cancel("long")
    stream.wait_done({"long", "short"})
    long = stream.results["long"]
    assert long.completions[0].finish_reason == pb.FINISH_REASON_ABORT
    assert long.usage.completion_tokens < 1000
    assert stream.results["short"].usage.completion_tokens == 4
    stream.drain()
    assert kv_cache_usage(engine) == 0.0


def test_disconnect_frees_blocks(stub, engine):
    stream = GenerateStream(stub)
    stream.start("gone", text="Write a long story:", **greedy(1000, ignore_eos=True))
    while len(stream.results["gone"].tokens) < 2:
        stream.next()
    stream._call.cancel()
    deadline = time.monotonic() + 10
    while kv_cache_usage(engine) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_cache_usage(engine) == 0.0


def test_deadline_exceeded(stub):
    stream = GenerateStream(stub, timeout=1.0)
    stream.start("slow", text="Tell me everything:", **greedy(1000, ignore_eos=True))
    with pytest.raises(grpc.RpcError) as e:
        while True:
            stream.next()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


BAD_STARTS = [
    ("empty-text", {"text": ""}, "text"),
    ("no-input", {}, "input"),
    ("too-long", {"token_ids": pb.TokenIds(ids=[5] * 2048)}, "input"),
    ("bad-token", {"token_ids": pb.TokenIds(ids=[1, 10**6])}, "token_ids"),
    ("max-tokens-0", {"text": "hi", "stopping": pb.StoppingCriteria(max_tokens=0)}, "stopping.max_tokens"),
    ("max-tokens-big", {"text": "hi", "stopping": pb.StoppingCriteria(max_tokens=5000)}, "stopping.max_tokens"),
    ("temperature", {"text": "hi", "sampling": pb.SamplingParams(temperature=-0.5)}, "sampling.temperature"),
    ("top-p-0", {"text": "hi", "sampling": pb.SamplingParams(top_p=0.0)}, "sampling.top_p"),
    ("top-p-big", {"text": "hi", "sampling": pb.SamplingParams(top_p=1.5)}, "sampling.top_p"),
    ("bad-role", {"chat": pb.ChatInput(messages=[pb.ChatMessage(role="robot", content="x")])}, "chat.messages[0].role"),
    ("no-content", {"chat": pb.ChatInput(messages=[pb.ChatMessage(role="user")])}, "chat.messages[0].content"),
    ("no-messages", {"chat": pb.ChatInput()}, "chat.messages"),
    ("bad-tools", {"chat": pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")], tools_json="{")},
     "chat.tools_json"),
]


def test_invalid_requests_get_invalid_argument_in_band_and_stream_carries_on(stub):
    stream = GenerateStream(stub)
    stream.start("ok-1", text="The sky is", **greedy(8))
    for rid, fields, _ in BAD_STARTS:
        stream.start(rid, **fields)
    stream.start("ok-1", text="duplicate", **greedy(4))  # same id while ok-1 runs
    stream.cancel("nobody")
    stream.start("ok-2", text="Water is", **greedy(8))
    stream.drain()
    for rid, _, field_path in BAD_STARTS:
        error = stream.results[rid].error
        assert error is not None, rid
        assert (error.code, error.field) == (INVALID_ARGUMENT, field_path), (rid, error)
        assert error.message
    rejected = {(r.request_id, r.error.field) for r in stream.errors}
    assert ("ok-1", "start.request_id") in rejected
    assert ("nobody", "cancel.request_id") in rejected
    for rid in ("ok-1", "ok-2"):
        assert stream.results[rid].usage.completion_tokens == 8
        assert stream.results[rid].completions[0].finish_reason == pb.FINISH_REASON_LENGTH


def test_prompt_too_long_message_names_both_numbers(stub):
    stream = GenerateStream(stub)
    stream.start("x", token_ids=pb.TokenIds(ids=[5] * 3000))
    stream.drain()
    assert "3000" in stream.results["x"].error.message and "2048" in stream.results["x"].error.message


def test_stop_string_and_logprobs(stub):
    full = GenerateStream(stub)
    full.start("f", text="1, 2, 3, 4, 5,", **greedy(12))
    full.drain()
    text = full.results["f"].text
    assert " 7" in text, text
    stop = GenerateStream(stub)
    sampling = pb.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3)
    stop.start("s", text="1, 2, 3, 4, 5,", sampling=sampling, stopping=pb.StoppingCriteria(max_tokens=12, stop=[" 7"]))
    stop.drain()
    c = stop.results["s"].completions[0]
    assert c.text == text[: text.index(" 7")]
    assert (c.finish_reason, c.stop_reason) == (pb.FINISH_REASON_STOP, " 7")
    assert len(c.logprobs) == len(c.token_ids)
    for lp, token_id in zip(c.logprobs, c.token_ids):
        assert lp.token_id == token_id and lp.logprob <= 0
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token_id == token_id  # greedy picks the most likely
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)


def test_n_completions_and_seed(stub):
    sampling = pb.SamplingParams(temperature=1.0, seed=1234)
    runs = []
    for _ in range(2):
        stream = GenerateStream(stub)
        stream.start("n", text="My favourite colour is", n=3, sampling=sampling,
                     stopping=pb.StoppingCriteria(max_tokens=8, ignore_eos=True))
        stream.drain()
        result = stream.results["n"]
        assert sorted(result.completions) == [0, 1, 2]
        assert result.usage.completion_tokens == 24
        runs.append([result.completions[i].token_ids for i in range(3)])
    assert runs[0] == runs[1]  # same seed, same outputs
    assert len({tuple(t) for t in runs[0]}) > 1  # the n completions differ


def test_prefix_cache_reports_cached_tokens(stub):
    long_prompt = "You are a helpful assistant. " * 20
    first, second = GenerateStream(stub), GenerateStream(stub)
    first.start("p1", text=long_prompt + "Say hi.", **greedy(2))
    first.drain()
    second.start("p2", text=long_prompt + "Say bye.", **greedy(2))
    second.drain()
    usage = second.results["p2"].usage
    assert usage.cached_tokens >= 96 and usage.cached_tokens % 16 == 0
    assert usage.cached_tokens < usage.prompt_tokens


def test_health_and_reflection(engine):
    with grpc.insecure_channel(engine.target) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="inference.v1.InferenceService"), timeout=5
        ).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in responses[0].list_services_response.service}
        assert {"inference.v1.InferenceService", "grpc.health.v1.Health"} <= names


def test_model_info(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert (info.family, info.architecture) == ("llama", "LlamaForCausalLM")
    assert info.vocab_size == 49152 and info.max_context_length == 2048
    assert info.has_chat_template and "<|im_start|>" in info.chat_template
    assert list(info.special_tokens.eos_token_ids) == [2]
    assert info.kv_cache.block_size == 16 and info.kv_cache.num_blocks > 0
    assert info.supports_generate and info.supports_embed and info.embedding_dimensions == 576


def test_tokenize_detokenize_render(stub):
    requests = [
        pb.TokenizeRequest(request_id="t", tokenize=pb.TokenizeText(text="Hello world")),
        pb.TokenizeRequest(request_id="r", render_chat=CHAT),
        pb.TokenizeRequest(request_id="bad", detokenize=pb.DetokenizeIds(ids=[10**7])),
    ]
    responses = {r.request_id: r for r in stub.Tokenize(iter(requests), timeout=10)}
    ids = list(responses["t"].token_ids)
    assert len(ids) == 2 and len(responses["t"].tokens) == 2
    round_trip = next(iter(stub.Tokenize(iter([pb.TokenizeRequest(request_id="d", detokenize=pb.DetokenizeIds(ids=ids))]))))
    assert round_trip.text == "Hello world"
    assert responses["r"].text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?" in responses["r"].text
    assert (responses["bad"].error.code, responses["bad"].error.field) == (INVALID_ARGUMENT, "detokenize.ids")


def test_generative_model_also_embeds(stub):
    # Last-token pooling + L2 normalization by default (no sentence-transformers config in a GGUF).
    [r] = stub.Embed(iter([pb.EmbedRequest(request_id="e", inputs=[pb.EmbedInput(text="Hello world")])]), timeout=30)
    [emb] = r.embeddings
    assert (r.request_id, r.prompt_tokens, emb.num_tokens, len(emb.values)) == ("e", 2, 2, 576)
    assert abs(sum(v * v for v in emb.values) - 1.0) < 1e-4
