"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rest_proxy.protocol import CompletionRequest
from rest_proxy.routes.deps import Completions, Metrics
from rest_proxy.sse import event_stream

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(req: CompletionRequest, completions: Completions, metrics: Metrics):
    if req.stream:
        return await event_stream(await completions.stream(req), metrics)
    return JSONResponse(await completions.complete(req))
