"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter

from rest_proxy.protocol import CompletionRequest
from rest_proxy.routes.deps import Completions, Metrics
from rest_proxy.routes.generate import answer

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(req: CompletionRequest, completions: Completions, metrics: Metrics):
    return await answer(completions, req, metrics)
