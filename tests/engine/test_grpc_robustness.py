"""Hostile input to the engine over gRPC harms only itself: a prompt too long for any context is refused
before it is tokenized (while other streams are served), reserved chat-template variables and unexpected
failures end their own request in-band with the stream alive, and a client that stops reading has its
requests aborted and their KV blocks freed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time

import grpc
import psutil
import pytest

from inference_service.api import pb, pb_grpc
from inference_service.config import CacheConfig, EngineConfig, ServerConfig
from tests.grpc_client import GenerateStream, greedy, kv_cache_usage, start_engine

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
INTERNAL = grpc.StatusCode.INTERNAL.value[0]
MAX_STALL_S = 1.0
RESERVED = ["messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "special_tokens"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc = start_engine("--max-model-len", "2048", "--kv-cache-memory", "256", "--max-stream-stall", str(MAX_STALL_S),
                        log_path=str(log))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def stub(engine):
    with grpc.insecure_channel(engine.target) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def chat(content: str, **fields) -> pb.ChatInput:
    return pb.ChatInput(messages=[pb.ChatMessage(role="user", content=content)], **fields)


def answer_alone(stub, **fields) -> GenerateStream:
    stream = GenerateStream(stub)
    stream.start("small", **fields)
    stream.drain()
    return stream


@pytest.mark.parametrize("field, fields", [
    ("text", {"text": "word " * 2_400_000}),  # 12 MB: tokenizing it would take seconds
    ("chat.messages", {"chat": chat("word " * 600_000)}),  # 3 MB
], ids=["text", "chat"])
def test_a_prompt_longer_than_any_context_is_refused_before_tokenizing(engine, stub, field, fields):
    rss_before = psutil.Process(engine.process.pid).memory_info().rss
    reference = answer_alone(stub, text="The sky is", **greedy(8)).results["small"].tokens
    big = GenerateStream(stub)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        big.start("big", **fields)
        small = pool.submit(answer_alone, stub, text="The sky is", **greedy(8))
        big.wait_done({"big"})
        seconds = time.monotonic() - start
        assert small.result().results["small"].tokens == reference
    big.drain()
    error = big.results["big"].error
    assert (error.code, error.field) == (INVALID_ARGUMENT, field)
    assert "context length of 2048 tokens" in error.message
    assert seconds < 1.0
    assert abs(psutil.Process(engine.process.pid).memory_info().rss - rss_before) <= 0.1 * rss_before


def test_reserved_template_kwargs_are_refused_in_band_and_the_stream_carries_on(stub):
    stream = GenerateStream(stub)
    for key in RESERVED:
        stream.start(key, chat=chat("hi", chat_template_kwargs_json=f'{{"{key}": [], "x": 1}}'), **greedy(4))
    stream.wait_done(set(RESERVED))
    stream.start("after", chat=chat("hi", chat_template_kwargs_json='{"x": 1}'), **greedy(4))
    stream.drain()
    for key in RESERVED:
        error = stream.results[key].error
        assert (error.code, error.field) == (INVALID_ARGUMENT, "chat.chat_template_kwargs_json"), key
        assert f"'{key}'" in error.message and "'x'" not in error.message
    assert stream.results["after"].usage.completion_tokens == 4
    # Tokenize's render_chat takes the same input and answers the same, in-band.
    [rendered] = stub.Tokenize(iter([pb.TokenizeRequest(
        request_id="r", render_chat=chat("hi", chat_template_kwargs_json='{"tools": []}'))]), timeout=30)
    assert (rendered.error.code, rendered.error.field) == (INVALID_ARGUMENT, "chat.chat_template_kwargs_json")


def test_a_client_that_stops_reading_has_its_requests_aborted_and_blocks_freed(engine):
    # No BDP probing: the flow-control window stays at its initial size, which the logprobs fill in a few steps.
    with grpc.insecure_channel(engine.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
        sampling = pb.SamplingParams(temperature=0.0, logprobs=True, top_logprobs=20)
        stream.start("unread", text="Count:", n=4, sampling=sampling,
                     stopping=pb.StoppingCriteria(max_tokens=1500, ignore_eos=True))
        deadline = time.monotonic() + 120
        while kv_cache_usage(engine) == 0.0:  # scheduled
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while kv_cache_usage(engine) > 0.0:  # aborted while nobody reads
            assert time.monotonic() < deadline, "the unread request kept its blocks"
            time.sleep(0.05)
        stream.wait_done({"unread"})
        result = stream.results["unread"]
        assert result.error.code == RESOURCE_EXHAUSTED
        assert result.error.message == f"request aborted: the client has not read a response for {MAX_STALL_S:g} s"
        assert 0 < len(result.tokens) < 1500
        # The stream itself lives on.
        stream.start("next", text="The sky is", **greedy(4))
        stream.drain()
        assert stream.results["next"].usage.completion_tokens == 4


@pytest.fixture(scope="module")
def inprocess_server():
    """An engine server in this process (a thread with its own event loop), so a test can inject a fault."""
    from inference_service.server import EngineServer

    started: queue.Queue = queue.Queue()

    async def serve() -> None:
        server = EngineServer(EngineConfig(max_model_len=256, cache=CacheConfig(kv_cache_memory_mib=16)),
                              ServerConfig(host="127.0.0.1", port=0, engine_in_process=True))
        await server.start()
        started.put((server, asyncio.get_running_loop()))
        await server.wait_for_shutdown()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    server, loop = started.get(timeout=180)
    yield server
    loop.call_soon_threadsafe(server.request_shutdown)
    thread.join(60)


def test_an_unexpected_error_ends_its_request_in_band_and_the_stream_carries_on(inprocess_server):
    processor = inprocess_server.servicer.input_processor
    process = processor.process

    def faulty(request_id, prompt, *args):
        if prompt == "boom":
            raise RuntimeError("injected fault")
        return process(request_id, prompt, *args)

    processor.process = faulty
    try:
        with grpc.insecure_channel(f"127.0.0.1:{inprocess_server.port}") as channel:
            stream = GenerateStream(pb_grpc.InferenceServiceStub(channel))
            stream.start("before", text="The sky is", **greedy(4))
            stream.start("boom", text="boom", **greedy(4))
            stream.wait_done({"before", "boom"})
            stream.start("after", text="The sky is", **greedy(4))
            stream.drain()
    finally:
        processor.process = process
    error = stream.results["boom"].error
    assert error.code == INTERNAL and error.message == "internal error: RuntimeError: injected fault"
    assert stream.results["before"].usage.completion_tokens == 4
    assert stream.results["after"].usage.completion_tokens == 4
