"""The bytes of chat and completions streams, pinned: the SSE framing, the chunk fields and their order,
`usage` (null on every chunk, then a usage-only chunk) with include_usage, and the closing `[DONE]`.

The OpenAI SDKs parse exactly this; a refactor of the stream writers must leave it unchanged. Only the
random id and the creation time are normalized."""

from __future__ import annotations

import re

import httpx

CHAT_N2_LOGPROBS_USAGE = [
    'data: {"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}], "usage": null}',
    'data: {"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "delta": {"content": "ab "}, "logprobs": {"content": [{"token": "ab ", "logprob": -0.5, "bytes": [97, 98, 32], "top_logprobs": [{"token": "ab ", "logprob": -0.5, "bytes": [97, 98, 32]}]}], "refusal": null}, "finish_reason": null}], "usage": null}',
    'data: {"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "delta": {"content": "cd"}, "logprobs": {"content": [{"token": "cd", "logprob": -1.5, "bytes": [99, 100], "top_logprobs": [{"token": "cd", "logprob": -1.5, "bytes": [99, 100]}]}], "refusal": null}, "finish_reason": null}], "usage": null}',
    'data: {"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"}], "usage": null}',
    'data: {"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}], "usage": null}',
    'data: {"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 1, "delta": {"content": "efg"}, "logprobs": {"content": [{"token": "efg", "logprob": -0.5, "bytes": [101, 102, 103], "top_logprobs": [{"token": "efg", "logprob": -0.5, "bytes": [101, 102, 103]}]}], "refusal": null}, "finish_reason": null}], "usage": null}',
    'data: {"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 1, "delta": {}, "logprobs": null, "finish_reason": "stop"}], "usage": null}',
    'data: {"id": "chatcmpl-ID", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [], "usage": {"prompt_tokens": 18, "completion_tokens": 3, "total_tokens": 21, "prompt_tokens_details": {"cached_tokens": 3}}}',
    'data: [DONE]',
]

COMPLETIONS_ECHO_LOGPROBS_USAGE = [
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "text": "p1one", "logprobs": {"tokens": ["p", "1", "one"], "token_logprobs": [null, -0.5, -0.5], "top_logprobs": [null, {"1": -0.5}, {"one": -0.5}], "text_offset": [0, 1, 2]}, "finish_reason": null}], "usage": null}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "text": " tw", "logprobs": {"tokens": [" tw"], "token_logprobs": [-1.5], "top_logprobs": [{" tw": -1.5}], "text_offset": [5]}, "finish_reason": null}], "usage": null}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "text": "o", "logprobs": {"tokens": ["o"], "token_logprobs": [-2.5], "top_logprobs": [{"o": -2.5}], "text_offset": [8]}, "finish_reason": "stop"}], "usage": null}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "text": "", "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, "finish_reason": null}], "usage": null}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 1, "text": "p2Hel", "logprobs": {"tokens": ["p", "2", "Hel"], "token_logprobs": [null, -0.5, -0.5], "top_logprobs": [null, {"2": -0.5}, {"Hel": -0.5}], "text_offset": [0, 1, 2]}, "finish_reason": null}], "usage": null}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 1, "text": "lo ", "logprobs": {"tokens": ["lo "], "token_logprobs": [-1.5], "top_logprobs": [{"lo ": -1.5}], "text_offset": [5]}, "finish_reason": null}], "usage": null}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 1, "text": "fro", "logprobs": {"tokens": ["fro"], "token_logprobs": [-2.5], "top_logprobs": [{"fro": -2.5}], "text_offset": [8]}, "finish_reason": "length"}], "usage": null}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 1, "text": "", "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, "finish_reason": null}], "usage": null}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 6}}}',
    'data: [DONE]',
]

COMPLETIONS_PLAIN = [
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "text": "one", "logprobs": null, "finish_reason": null}]}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "text": " tw", "logprobs": null, "finish_reason": null}]}',
    'data: {"id": "cmpl-ID", "object": "text_completion", "created": 0, "model": "fake-model", "system_fingerprint": "fp_391e932458", "choices": [{"index": 0, "text": "o", "logprobs": null, "finish_reason": "stop"}]}',
    'data: [DONE]',
]


def raw_stream(proxy, path: str, body: dict) -> list[str]:
    """The stream's events (split at the blank line that ends each), id and created normalized."""
    with httpx.stream("POST", proxy.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = b"".join(r.iter_bytes()).decode()
    text = re.sub(r'"id": "(chatcmpl|cmpl)-[0-9a-f]{32}"', r'"id": "\1-ID"', text)
    text = re.sub(r'"created": \d+', '"created": 0', text)
    assert text.endswith("\n\n")
    return text.split("\n\n")[:-1]


def test_chat_stream_bytes_with_usage(proxy, engine):
    engine.script["sse"] = ["ab cd", "efg"]
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "sse"}], "n": 2, "stream": True,
            "logprobs": True, "top_logprobs": 1, "stream_options": {"include_usage": True}}
    assert raw_stream(proxy, "/v1/chat/completions", body) == CHAT_N2_LOGPROBS_USAGE


def test_completions_stream_bytes_with_usage(proxy, engine):
    engine.script["p1"] = "one two"
    body = {"model": "fake-model", "prompt": ["p1", "p2"], "max_tokens": 3, "echo": True, "logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True}}
    assert raw_stream(proxy, "/v1/completions", body) == COMPLETIONS_ECHO_LOGPROBS_USAGE


def test_completions_stream_bytes_without_usage(proxy, engine):
    engine.script["p1"] = "one two"
    body = {"model": "fake-model", "prompt": "p1", "stream": True}
    assert raw_stream(proxy, "/v1/completions", body) == COMPLETIONS_PLAIN
