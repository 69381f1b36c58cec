"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from rest_proxy.protocol import ChatCompletionRequest
from rest_proxy.routes.deps import Chat, Metrics
from rest_proxy.sse import event_stream

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, chat: Chat, metrics: Metrics):
    plan = await chat.plan(req)
    if req.stream:
        return await event_stream(chat.stream(plan), metrics)
    return JSONResponse(await chat.complete(plan))
