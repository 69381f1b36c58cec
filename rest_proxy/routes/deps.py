"""FastAPI dependencies: the services `create_app` keeps on `app.state`, and the API-key check of
`/health?detail=true` (the other routes are guarded by `ApiKeyMiddleware`, before their body is read)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from rest_proxy.auth import ApiKeyCheck, invalid_api_key
from rest_proxy.chat import ChatService
from rest_proxy.completions import CompletionService
from rest_proxy.engine_client import EngineRouter
from rest_proxy.mcp_manager import McpManager
from rest_proxy.metrics import ProxyMetrics
from rest_proxy.responses import ResponsesService


def _engines(request: Request) -> EngineRouter:
    return request.app.state.router


def _chat(request: Request) -> ChatService:
    return request.app.state.chat


def _completions(request: Request) -> CompletionService:
    return request.app.state.completions


def _responses(request: Request) -> ResponsesService:
    return request.app.state.responses


def _metrics(request: Request) -> ProxyMetrics:
    return request.app.state.metrics


def _mcp(request: Request) -> McpManager | None:
    return request.app.state.mcp


def _detail(request: Request, detail: bool = False) -> bool:
    """`?detail=true`: allowed to a caller holding the API key (anyone when there is none), else 401."""
    check: ApiKeyCheck = request.app.state.api_key_check
    if detail and not check.is_authorized(request.scope):
        raise invalid_api_key()
    return detail


Engines = Annotated[EngineRouter, Depends(_engines)]
Chat = Annotated[ChatService, Depends(_chat)]
Completions = Annotated[CompletionService, Depends(_completions)]
Responses = Annotated[ResponsesService, Depends(_responses)]
Metrics = Annotated[ProxyMetrics, Depends(_metrics)]
Mcp = Annotated[McpManager | None, Depends(_mcp)]
Detail = Annotated[bool, Depends(_detail)]
