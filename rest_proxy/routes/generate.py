"""The answer to a request that generates (chat, completions, responses): its event stream or its JSON."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi.responses import JSONResponse
from starlette.responses import Response

from rest_proxy.metrics import ProxyMetrics
from rest_proxy.sse import event_stream


class GeneratingService(Protocol):
    """Plans a request (its client errors raise here), then streams or completes the plan."""

    async def plan(self, req: Any) -> Any: ...

    def stream(self, plan: Any) -> AsyncIterator[str]: ...

    async def complete(self, plan: Any) -> dict: ...


async def answer(service: GeneratingService, req: Any, metrics: ProxyMetrics) -> Response:
    """SSE when `req.stream` (its first event waits for the engine, so errors before it keep their HTTP
    status), else the whole JSON object."""
    plan = await service.plan(req)
    if req.stream:
        return await event_stream(service.stream(plan), metrics)
    return JSONResponse(await service.complete(plan))
