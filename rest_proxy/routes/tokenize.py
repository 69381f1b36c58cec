"""POST /tokenize (a prompt, or chat messages as the template renders them) and POST /detokenize."""

from __future__ import annotations

from fastapi import APIRouter

from inference_service.api import pb
from rest_proxy.errors import invalid_request
from rest_proxy.protocol import DetokenizeRequest, TokenizeRequest
from rest_proxy.routes.deps import Chat, Engines
from rest_proxy.translate import chat_input, check_wire_safe, template_renders_tools

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, engines: Engines, chat: Chat):
    client = await engines.resolve(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise invalid_request("give exactly one of `prompt` or `messages`", "prompt")
    request = pb.TokenizeRequest()
    if req.prompt is not None:
        request.tokenize.text = req.prompt
        if req.add_special_tokens is not None:
            request.tokenize.add_special_tokens = req.add_special_tokens
    else:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        template = client.info.chat_template if client.info else ""
        parser = chat.parser_for(client)  # past calls are written in its markup even with no tools
        request.render_chat.CopyFrom(chat_input(
            req.messages, tools=tools, parser=parser, native_tools=template_renders_tools(template),
            add_generation_prompt=req.add_generation_prompt))
    check_wire_safe(request)
    resp = await client.tokenize(request)
    return {"tokens": list(resp.token_ids), "count": len(resp.token_ids), "token_strs": list(resp.tokens),
            "max_model_len": client.info.max_context_length if client.info else None}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, engines: Engines):
    client = await engines.resolve(req.model)
    request = pb.TokenizeRequest(detokenize=pb.DetokenizeIds(ids=req.tokens))
    if req.skip_special_tokens is not None:
        request.detokenize.skip_special_tokens = req.skip_special_tokens
    resp = await client.tokenize(request)
    return {"prompt": resp.text}
