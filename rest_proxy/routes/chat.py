"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter

from rest_proxy.protocol import ChatCompletionRequest
from rest_proxy.routes.deps import Chat, Metrics
from rest_proxy.routes.generate import answer

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, chat: Chat, metrics: Metrics):
    return await answer(chat, req, metrics)
