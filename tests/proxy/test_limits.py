"""What one HTTP client may hold in the proxy: body size (413), time to send the body (408) and the
headers (connection closed), reserved chat-template variables (400), and `/v1/models` before any
engine is up (503). Against the scripted engine: none of this reaches an engine."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.proxy.fake_engine import free_port

CHAT_PATH = "/v1/chat/completions"


def chat_body(num_bytes: int) -> bytes:
    return json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "a" * num_bytes}]}).encode()


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    sock.settimeout(timeout)
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_with_an_openai_error(start_proxy, fake_server, chunked):
    proxy = start_proxy(engines=[fake_server.target], max_body_bytes=1000)
    body = chat_body(2000)
    content = iter([body[:500], body[500:]]) if chunked else body
    r = httpx.post(proxy.url + CHAT_PATH, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "1000 bytes" in error["message"] and "--max-body-size" in error["message"]
    # The connection and the proxy carry on.
    assert httpx.post(proxy.url + CHAT_PATH, content=chat_body(10), timeout=30,
                      headers={"content-type": "application/json"}).status_code == 200


def test_a_body_at_the_limit_is_served(start_proxy, fake_server, engine):
    body = chat_body(10)
    proxy = start_proxy(engines=[fake_server.target], max_body_bytes=len(body))
    r = httpx.post(proxy.url + CHAT_PATH, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200


def test_a_body_not_sent_in_time_is_408(start_proxy, fake_server):
    proxy = start_proxy(engines=[fake_server.target], body_timeout=0.5)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")
        data, _ = read_until_closed(sock, timeout=30)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_client_trickling_its_headers_is_dropped(start_proxy, fake_server):
    proxy = start_proxy(engines=[fake_server.target], header_timeout=0.5)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        # A header byte every 50 ms: each one would re-arm uvicorn's keep-alive timer, not this one.
        with pytest.raises(OSError):
            while time.monotonic() - start < 30:
                sock.sendall(b"X")
                time.sleep(0.05)
    # Dropped, and not before its time was up.
    assert time.monotonic() - start >= 0.5


def test_a_client_that_never_sends_a_request_is_dropped(start_proxy, fake_server):
    proxy = start_proxy(engines=[fake_server.target], header_timeout=0.5)
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        data, seconds = read_until_closed(sock, timeout=30)
    assert data == b"" and seconds >= 0.4


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "continue_final_message",
                                 "special_tokens", "documents"])
def test_reserved_chat_template_kwargs_are_400_naming_key_and_field(client, key):
    r = httpx.post(str(client.base_url) + "chat/completions", timeout=30, json={
        "model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {key: [], "enable_thinking": False}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "chat_template_kwargs" and error["type"] == "invalid_request_error"
    assert f"'{key}'" in error["message"] and "enable_thinking" not in error["message"]


def test_models_is_503_until_an_engine_is_up(start_proxy):
    proxy = start_proxy(engines=[f"127.0.0.1:{free_port()}"], engine_refresh_interval=0.1)
    r = httpx.get(proxy.url + "/v1/models", timeout=30)
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable"
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert httpx.get(proxy.url + "/health", timeout=30).status_code == 503
