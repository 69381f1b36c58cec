"""POST /v1/embeddings."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter

from inference_service.api import pb
from rest_proxy.completions import prompt_inputs
from rest_proxy.errors import invalid_request
from rest_proxy.protocol import EmbeddingRequest
from rest_proxy.routes.deps import Engines
from rest_proxy.translate import check_wire_safe

router = APIRouter()


@router.post("/v1/embeddings")
async def create_embedding(req: EmbeddingRequest, engines: Engines):
    client = await engines.resolve(req.model)
    resp = await client.embed(_embed_request(req))
    data = []
    for i, emb in enumerate(resp.embeddings):
        values = list(emb.values)
        if req.encoding_format == "base64":
            values = base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": values})
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": resp.prompt_tokens, "total_tokens": resp.prompt_tokens}}


def _embed_request(req: EmbeddingRequest) -> pb.EmbedRequest:
    if isinstance(req.input, list) and not req.input:
        raise invalid_request("input must not be an empty list", "input")
    inputs = prompt_inputs(req.input) if not isinstance(req.input, str) else [req.input]
    request = pb.EmbedRequest(truncate=req.truncate, dimensions=req.dimensions or 0)
    for item in inputs:
        if isinstance(item, str):
            request.inputs.append(pb.EmbedInput(text=item))
        else:
            request.inputs.append(pb.EmbedInput(token_ids=pb.TokenIds(ids=item)))
    check_wire_safe(request)
    return request
