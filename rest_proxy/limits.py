"""Bounds on what one HTTP client may hold: the size of a request body and the time to send it, and the
time to send a request's headers.

uvicorn's `timeout_keep_alive` does not cover either: it is disarmed by any byte the client sends, so a
client trickling one header byte at a time, or a body one byte at a time, holds its connection (and a
request's buffers) forever. Headers are bounded in the HTTP protocol itself (`HeaderTimeoutH11Protocol`),
bodies by a middleware that reads them up front (`RequestBodyMiddleware`).
"""

from __future__ import annotations

import asyncio

import anyio
import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from rest_proxy.config import ProxyConfig
from rest_proxy.errors import ProxyError


class RequestBodyMiddleware:
    """Reads each request's body before the app sees it: more than `max_bytes` is answered 413 (at once when
    Content-Length says so, else as soon as the count passes it), a body not complete within `timeout`
    seconds 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    def _too_large(self) -> ProxyError:
        return ProxyError(413, f"the request body is larger than the proxy accepts ({self.max_bytes} bytes; "
                               f"`rest-proxy serve --max-body-size`)", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _answer(self._too_large(), scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        try:
            with anyio.fail_after(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > self.max_bytes:
                        await _answer(self._too_large(), scope, receive, send)
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            err = ProxyError(408, f"the request body did not arrive within {self.timeout:g} s "
                                  f"(`rest-proxy serve --body-timeout`)", type="invalid_request_error",
                             code="request_timeout")
            await _answer(err, scope, receive, send, close=True)
            return
        body: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        del chunks

        async def replay() -> Message:
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)


async def _answer(err: ProxyError, scope: Scope, receive: Receive, send: Send, close: bool = False) -> None:
    headers = {"Connection": "close"} if close else None
    await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not complete within
    `header_timeout` seconds of the connection opening or of the previous response ending (which also
    bounds how long the rest of a refused request's body may keep arriving)."""

    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._await_headers()

    def _await_headers(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete
            self._stop_header_timer()

    def on_response_complete(self) -> None:
        # Armed first: the base class may start a pipelined request right away (which stops the timer).
        self._await_headers()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)


def uvicorn_config(app: ASGIApp, config: ProxyConfig, **kwargs) -> uvicorn.Config:
    """uvicorn's configuration for the proxy: its HTTP protocol enforces `config.header_timeout`."""
    protocol = type("H11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout": config.header_timeout})
    return uvicorn.Config(app, http=protocol, **kwargs)
