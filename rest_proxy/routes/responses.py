"""POST /v1/responses, GET and DELETE /v1/responses/{id}."""

from __future__ import annotations

from fastapi import APIRouter

from rest_proxy.responses_protocol import ResponsesRequest
from rest_proxy.routes.deps import Metrics, Responses
from rest_proxy.routes.generate import answer

router = APIRouter()


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, service: Responses, metrics: Metrics):
    return await answer(service, req, metrics)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, service: Responses):
    return service.retrieve(response_id)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, service: Responses):
    return service.delete(response_id)
