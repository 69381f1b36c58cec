"""GET /version: the proxy's version (vLLM's endpoint) and the version of each engine behind it."""

from __future__ import annotations

from fastapi import APIRouter

from inference_service import ENGINE_VERSION
from rest_proxy.routes.deps import Engines

router = APIRouter()


@router.get("/version")
async def version(engines: Engines):
    """`{"version": proxy version, "engines": [{"model", "version"}]}`; an engine not reached yet is left out."""
    await engines.refresh_missing()
    return {"version": ENGINE_VERSION,
            "engines": [{"model": info.model_name, "version": info.engine_version} for info in engines.models()]}
