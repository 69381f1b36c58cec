"""Prometheus metrics of the proxy (one registry per app, so tests can build many apps).

Under `--workers N` every worker process writes its values to prometheus-client's multiprocess folder
(`rest_proxy/workers.py` makes it) and any worker's /metrics reads them all: counters and histograms are
summed over the workers (dead ones included, so totals never go back), `rest_proxy_sse_streams_open` is
the sum over live workers, `rest_proxy_mcp_tools` the most any live worker offers, and
`rest_proxy_worker_requests` has one series per live worker (label `pid`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ProxyMetrics:
    def __init__(self, multiprocess: bool = False) -> None:
        """`multiprocess`: this is one of several workers (PROMETHEUS_MULTIPROC_DIR set before
        prometheus-client was imported); /metrics then shows the sum over all of them."""
        self.registry = CollectorRegistry()
        self.multiprocess = multiprocess
        self.http_requests = Counter(
            "rest_proxy_http_requests_total", "HTTP requests answered, by route, method and status.",
            ["route", "method", "status"], registry=self.registry)
        self.http_latency = Histogram(
            "rest_proxy_http_request_duration_seconds",
            "Time from request to the end of the response (whole stream for SSE), by route.",
            ["route", "method"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.first_token_latency = Histogram(
            "rest_proxy_time_to_first_token_seconds", "Time from request to the first generated text.",
            ["endpoint"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.open_streams = Gauge(
            "rest_proxy_sse_streams_open", "Server-sent-event streams currently open.",
            registry=self.registry, multiprocess_mode="livesum")
        self.grpc_errors = Counter(
            "rest_proxy_grpc_errors_total", "Errors from the engine (calls and in-band), by gRPC code.",
            ["code"], registry=self.registry)
        self.mcp_tool_calls = Counter(
            "rest_proxy_mcp_tool_calls_total", "MCP tool calls run by the proxy, by server, tool and outcome.",
            ["server", "tool", "outcome"], registry=self.registry)
        self.mcp_tools = Gauge(
            "rest_proxy_mcp_tools", "MCP tools currently offered, by server.", ["server"],
            registry=self.registry, multiprocess_mode="livemax")
        self.worker_requests = Gauge(
            "rest_proxy_worker_requests",
            "HTTP requests this worker process answered (/metrics scrapes excepted), since it started; "
            "with --workers, one series per live worker (label pid): how evenly the kernel spreads connections.",
            registry=self.registry, multiprocess_mode="liveall")
        self.worker_requests.set(0)  # a started worker is listed before its first request

    def record_grpc_error(self, code: str) -> None:
        self.grpc_errors.labels(code=code).inc()

    def render(self) -> Response:
        if self.multiprocess:
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def _route_name(scope: Scope, routes: Callable[[], Sequence[BaseRoute]]) -> str:
    """The route's path template; for a request answered before routing (a 401 from the key check, a 503
    while draining), the template of the one of `routes` it would have reached. Unknown paths are
    `unmatched`, so probing random paths adds no label values."""
    path = getattr(scope.get("route"), "path", None)
    if path:
        return path
    for candidate in routes():
        match, _ = candidate.matches(scope)
        if match != Match.NONE:
            return candidate.path
    return "unmatched"


class MetricsMiddleware:
    """Counts requests and measures latency up to the last body byte (pure ASGI, safe for streaming)."""

    def __init__(self, app: ASGIApp, metrics: ProxyMetrics, routes: Callable[[], Sequence[BaseRoute]]):
        """`routes`: the app's routes with a path template, for naming requests answered before routing."""
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 499  # no response at all: the client went away first

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            status = 500 if status == 499 else status
            raise
        finally:
            route, method = _route_name(scope, self.routes), scope.get("method", "")
            self.metrics.http_requests.labels(route=route, method=method, status=str(status)).inc()
            self.metrics.http_latency.labels(route=route, method=method).observe(time.perf_counter() - start)
            if scope.get("path") != "/metrics":
                self.metrics.worker_requests.inc()

