"""POST /score and /rerank: how relevant texts are to a query, by the cosine similarity of their embeddings.

What vLLM computes for an embedding model (a bi-encoder such as all-MiniLM-L6-v2): both sides embedded by the
engine's `Embed`, every text once in one call, and compared here in float64. `/rerank` (also `/v1/rerank` and
`/v2/rerank`) speaks the request and answer of vLLM's rerank API, which Jina's and Cohere's clients use."""

from __future__ import annotations

import re
import time
import uuid

import numpy as np
from fastapi import APIRouter

from inference_service.api import pb
from rest_proxy.engine_client import EngineClient
from rest_proxy.errors import ProxyError, invalid_request
from rest_proxy.protocol import RerankRequest, ScoreRequest
from rest_proxy.routes.deps import Engines
from rest_proxy.translate import check_wire_safe

router = APIRouter()


@router.post("/score")
@router.post("/v1/score")
async def score(req: ScoreRequest, engines: Engines):
    queries, q_names = _texts(req.text_1, "text_1")
    items, i_names = _texts(req.text_2, "text_2")
    if len(queries) > 1 and len(queries) != len(items):
        raise invalid_request(f"text_1 holds {len(queries)} texts and text_2 {len(items)}: give one text_1 to "
                              f"score against every text_2, or as many as text_2 to score pair by pair", "text_1")
    client = await engines.resolve(req.model)
    vectors, num_tokens = await _embed(client, [*queries, *items], [*q_names, *i_names], req.truncate)
    scores = _cosine(vectors[:len(queries)], vectors[len(queries):])
    return {"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": req.model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}}


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(req: RerankRequest, engines: Engines):
    client = await engines.resolve(req.model)
    names = ["query", *(f"documents[{i}]" for i in range(len(req.documents)))]
    vectors, num_tokens = await _embed(client, [req.query, *req.documents], names, req.truncate)
    scores = _cosine(vectors[:1], vectors[1:])
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: equal scores keep document order
    results = []
    for i in order[:req.top_n or None]:
        result = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": req.documents[i]}
        results.append(result)
    return {"id": "rerank-" + uuid.uuid4().hex, "model": req.model, "usage": {"total_tokens": num_tokens},
            "results": results}


def _texts(value: str | list[str], param: str) -> tuple[list[str], list[str]]:
    """The texts of a field and the name of each in errors."""
    if isinstance(value, str):
        return [value], [param]
    if not value:
        raise invalid_request(f"{param} must not be an empty list", param)
    return value, [f"{param}[{i}]" for i in range(len(value))]


async def _embed(client: EngineClient, texts: list[str], names: list[str],
                 truncate: bool) -> tuple[np.ndarray, int]:
    """[len(texts), dim] float64 embeddings and the tokens they took; an engine error about `inputs[k]` is
    reported against the client's own field, `names[k]`."""
    request = pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in texts], truncate=truncate)
    check_wire_safe(request)
    try:
        resp = await client.embed(request)
    except ProxyError as err:
        raise _renamed(err, names) from None
    return np.array([list(e.values) for e in resp.embeddings], dtype=np.float64), resp.prompt_tokens


def _renamed(err: ProxyError, names: list[str]) -> ProxyError:
    def name(match: re.Match) -> str:
        return names[int(match.group(1))]

    param = re.sub(r"^inputs\[(\d+)\]", name, err.param) if err.param else err.param
    return ProxyError(err.status, re.sub(r"\binputs\[(\d+)\]", name, err.message), type=err.type, param=param,
                      code=err.code)


def _cosine(queries: np.ndarray, items: np.ndarray) -> list[float]:
    """Row i of `items` against row i of `queries`, or against its only row."""
    queries = np.broadcast_to(queries, items.shape)
    norms = np.linalg.norm(queries, axis=1) * np.linalg.norm(items, axis=1)
    return (np.einsum("ij,ij->i", queries, items) / np.maximum(norms, 1e-12)).tolist()
