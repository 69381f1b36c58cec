"""Graceful shutdown: on SIGTERM the proxy first turns unhealthy and refuses new requests with 503,
lets in-flight requests finish for up to `shutdown_timeout` seconds, and only then stops uvicorn.

Plain uvicorn closes its listening socket at once on SIGTERM, so a load balancer sees refused
connections instead of a 503 it can retry elsewhere, and /health never says it is going away.
"""

from __future__ import annotations

import logging
import time

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from rest_proxy.errors import ProxyError

log = logging.getLogger(__name__)


class DrainState:
    """Shared between the middleware (counts requests) and the server (decides when to stop)."""

    def __init__(self) -> None:
        self.draining = False
        self.num_in_flight = 0


class DrainMiddleware:
    """Outermost middleware: counts HTTP requests in flight; while draining answers new ones 503
    (`/metrics` excepted, so the drain itself can be watched)."""

    def __init__(self, app: ASGIApp, state: DrainState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining and scope.get("path") != "/metrics":
            err = ProxyError(503, "the proxy is shutting down; retry on another replica",
                             type="service_unavailable", code="shutting_down")
            response = JSONResponse(err.body(), status_code=503, headers={"Connection": "close", "Retry-After": "1"})
            await response(scope, receive, send)
            return
        self.state.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT starts a drain; a second one stops at once."""

    def __init__(self, config: uvicorn.Config, state: DrainState, shutdown_timeout: float):
        super().__init__(config)
        self.drain = state
        self.shutdown_timeout = shutdown_timeout
        self._deadline = 0.0

    def handle_exit(self, sig, frame) -> None:
        if self.drain.draining or self.shutdown_timeout <= 0:
            super().handle_exit(sig, frame)
            return
        self.drain.draining = True
        self._deadline = time.monotonic() + self.shutdown_timeout
        log.info("draining: %d requests in flight, up to %.0fs", self.drain.num_in_flight, self.shutdown_timeout)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.draining and not self.should_exit:
            if self.drain.num_in_flight == 0 or time.monotonic() >= self._deadline:
                if self.drain.num_in_flight:
                    log.warning("shutdown timeout: %d requests still in flight are cut off",
                                self.drain.num_in_flight)
                self.should_exit = True
        return await super().on_tick(counter)
