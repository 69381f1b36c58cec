"""The FastAPI application: OpenAI-compatible routes over the engine's gRPC API.

`create_app` builds the services, keeps them on `app.state` (where the routes' dependencies find them),
and assembles the middleware and the routers of `rest_proxy/routes/`."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.routing import BaseRoute

from rest_proxy.auth import ApiKeyCheck, ApiKeyMiddleware
from rest_proxy.chat import ChatService
from rest_proxy.completions import CompletionService
from rest_proxy.config import ProxyConfig
from rest_proxy.disconnect import CancelOnDisconnectMiddleware
from rest_proxy.drain import DrainMiddleware, DrainState
from rest_proxy.engine_auth import channel_credentials
from rest_proxy.engine_client import EngineRouter
from rest_proxy.errors import ProxyError, install_error_handlers
from rest_proxy.limits import RequestBodyMiddleware
from rest_proxy.mcp_manager import McpManager
from rest_proxy.metrics import MetricsMiddleware, ProxyMetrics
from rest_proxy.responses import ResponsesService
from rest_proxy.responses_store import open_response_store
from rest_proxy.routes import chat, completions, embeddings, health, models, responses, score, tokenize, version
from rest_proxy.ui import mount_ui

ROUTERS = [module.router for module in (chat, responses, completions, embeddings, score, models, tokenize, health,
                                        version)]


def create_app(config: ProxyConfig) -> FastAPI:
    docs = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="inference-service OpenAI-compatible proxy", version="0.1.0", lifespan=_lifespan, **docs)
    _build_services(app.state, config)
    install_error_handlers(app)
    app.add_middleware(CancelOnDisconnectMiddleware)
    app.add_middleware(RequestBodyMiddleware, max_bytes=config.max_body_bytes, timeout=config.body_timeout)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics, routes=lambda: _path_routes(app))
    app.add_middleware(DrainMiddleware, state=app.state.drain)  # outermost: sees every request
    for router in ROUTERS:
        app.include_router(router)
    mount_ui(app, config)  # the chat UI at / when config.ui
    return app


def _path_routes(app: FastAPI) -> list[BaseRoute]:
    """The routes with a path template: the app's own (the docs) and the included routers'. NOTE: FastAPI
    keeps an included router as one entry of `app.routes`, without a path of its own."""
    own = [route for route in app.routes if getattr(route, "path", None)]
    return own + [route for router in ROUTERS for route in router.routes]


def _build_services(state, config: ProxyConfig) -> None:
    """The services the routes use, on `app.state`."""
    state.config = config
    state.metrics = metrics = ProxyMetrics(multiprocess=config.workers > 1)
    state.router = router = EngineRouter(
        config.engines, request_timeout=config.request_timeout, on_grpc_error=metrics.record_grpc_error,
        refresh_interval=config.engine_refresh_interval,
        credentials=channel_credentials(config.engine_tls_ca, config.engine_tls_cert, config.engine_tls_key),
        api_key=config.engine_api_key)
    state.mcp = mcp = McpManager(config.mcp_servers, metrics=metrics, ping_interval=config.mcp_ping_interval,
                                 max_backoff=config.mcp_max_backoff) if config.mcp_servers else None
    state.chat = ChatService(router, metrics=metrics, mcp=mcp, tool_parser=config.tool_parser,
                             reasoning_parser=config.reasoning_parser, mcp_execute=config.mcp_execute,
                             max_mcp_rounds=config.max_mcp_rounds)
    state.completions = CompletionService(router, metrics=metrics)
    state.responses_store = open_response_store(config.responses_store_size, config.responses_store_ttl,
                                                config.responses_store_path)
    state.responses = ResponsesService(state.chat, state.responses_store, metrics)
    state.api_key_check = ApiKeyCheck(config.api_key)
    state.drain = DrainState()


@asynccontextmanager
async def _lifespan(app: FastAPI):
    """Engine connections and MCP sessions live as long as the server."""
    router, mcp = app.state.router, app.state.mcp
    await router.start()
    if mcp is not None:
        await mcp.start(wait=app.state.config.mcp_startup_wait)
    try:
        yield
    finally:
        if mcp is not None:
            await mcp.stop()
        await router.close()


__all__ = ["ProxyError", "create_app"]
