"""Large input at the proxy harms nobody else: 10 MB and 50 MB bodies are refused at once (413) while a
small chat is served, and a completions batch larger than the engine's queue is refused up front (429)
while concurrent chats are served; a batch the queue takes runs multiplexed on one Generate stream."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading
import time

import openai
import psutil
import pytest
from openai import OpenAI

from tests.reliability.conftest import MAX_WAITING

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def sdk(small_proxy) -> OpenAI:
    return OpenAI(base_url=small_proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(sdk) -> str:
    return sdk.models.list().data[0].id


def small_chat(sdk: OpenAI, model: str) -> str:
    return sdk.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0).choices[0].finish_reason


def post_large_body(port: int, num_bytes: int) -> tuple[bytes, float]:
    """Sends a chat request with a `num_bytes` body (from a second thread, as a client that writes all of it
    before reading would) and returns the response head and the seconds from the first byte sent to it."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * num_bytes}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)

        def send() -> None:
            try:
                sock.sendall(head + body)
            except OSError:
                pass  # the proxy may close once it has answered

        sender = threading.Thread(target=send)
        start = time.monotonic()
        sender.start()
        response = b""
        while b"\r\n\r\n" not in response:
            chunk = sock.recv(65536)
            assert chunk, "connection closed without an answer"
            response += chunk
        seconds = time.monotonic() - start
        sender.join(30)
    return response, seconds


@pytest.mark.parametrize("num_bytes", [10 * 10**6, 50 * 10**6], ids=["10MB", "50MB"])
def test_large_bodies_are_413_within_a_second_and_a_concurrent_chat_is_served(small_engine, small_proxy, sdk,
                                                                             model, num_bytes):
    engine_process = psutil.Process(small_engine.process.pid)
    rss_before = engine_process.memory_info().rss
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        chat = pool.submit(small_chat, sdk, model)
        response, seconds = post_large_body(small_proxy.port, num_bytes)
        assert chat.result() == "length"
    assert response.startswith(b"HTTP/1.1 413 "), response[:200]
    assert seconds < 1.0
    assert abs(engine_process.memory_info().rss - rss_before) <= 0.1 * rss_before


def test_a_completions_batch_larger_than_the_queue_is_429_up_front_and_chats_are_served(sdk, model):
    with concurrent.futures.ThreadPoolExecutor(MAX_WAITING) as pool:
        chats = [pool.submit(small_chat, sdk, model) for _ in range(MAX_WAITING - 1)]
        with pytest.raises(openai.RateLimitError) as e:
            sdk.completions.create(model=model, prompt=[f"Number {i}:" for i in range(3000)], max_tokens=1)
        assert [c.result() for c in chats] == ["length"] * (MAX_WAITING - 1)
    error = e.value.body
    assert error["code"] == "too_many_prompts" and error["param"] == "prompt"
    assert "3000 completions" in error["message"] and f"({MAX_WAITING})" in error["message"]
    # n counts: each prompt's n completions wait in the queue.
    with pytest.raises(openai.RateLimitError):
        sdk.completions.create(model=model, prompt=["a", "b", "c"], n=2, max_tokens=1)


def test_a_batch_the_queue_takes_runs_on_one_stream(small_engine, sdk, model):
    prompts = [f"Number {i}:" for i in range(MAX_WAITING)]
    alone = [sdk.completions.create(model=model, prompt=p, max_tokens=3, temperature=0).choices[0].text
             for p in prompts]
    log_start = len(small_engine.log())
    batch = sdk.completions.create(model=model, prompt=prompts, max_tokens=3, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == alone
    # The engine names each request "<stream id>-<request id>": all of the batch shares one stream.
    finished = re.findall(r"request (\w+)-\w+ finished", small_engine.log()[log_start:])
    assert len(finished) == MAX_WAITING and len(set(finished)) == 1
