"""GET /v1/models and GET /v1/models/{model}: the models the engines serve."""

from __future__ import annotations

import time
from pathlib import PurePath

from fastapi import APIRouter

from inference_service.api import pb
from rest_proxy.routes.deps import Engines

router = APIRouter()
_CREATED = int(time.time())


def model_card(info: pb.GetModelInfoResponse) -> dict:
    # NOTE: the file's name, never its path: where models live on the engines' disks is not the
    # clients' business.
    root = PurePath(info.model_path.rstrip("/\\")).name or info.model_name
    card = {"id": info.model_name, "object": "model", "created": _CREATED, "owned_by": "inference-service",
            "root": root, "max_model_len": info.max_context_length}
    if info.quantization:  # an engine older than the field says nothing rather than "none"
        card["quantization"] = {"method": info.quantization, "bits": info.quantization_bits,
                                "weight_bytes": info.weight_bytes}
    return card


@router.get("/v1/models")
async def list_models(engines: Engines):
    await engines.refresh_missing()
    models = engines.models()
    if not models:  # not "no models": nothing to ask yet, as /health says
        raise engines.unavailable()
    return {"object": "list", "data": [model_card(info) for info in models]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, engines: Engines):
    return model_card((await engines.resolve(model)).info)
