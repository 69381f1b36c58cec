"""The FastAPI application: OpenAI-compatible routes over the engine's gRPC API."""

from __future__ import annotations

import base64
import logging
import time
from contextlib import asynccontextmanager
from pathlib import PurePath

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from inference_service.api import pb
from rest_proxy.auth import ApiKeyCheck, ApiKeyMiddleware, invalid_api_key
from rest_proxy.chat import ChatService
from rest_proxy.completions import CompletionService, prompt_inputs
from rest_proxy.config import ProxyConfig
from rest_proxy.disconnect import CancelOnDisconnectMiddleware
from rest_proxy.drain import DrainMiddleware, DrainState
from rest_proxy.engine_auth import channel_credentials
from rest_proxy.engine_client import EngineRouter
from rest_proxy.errors import ProxyError, install_error_handlers, invalid_request
from rest_proxy.limits import RequestBodyMiddleware
from rest_proxy.mcp_manager import McpManager
from rest_proxy.metrics import MetricsMiddleware, ProxyMetrics
from rest_proxy.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                 TokenizeRequest)
from rest_proxy.responses import ResponsesService, build_router
from rest_proxy.responses_store import ResponseStore
from rest_proxy.sse import event_stream
from rest_proxy.translate import chat_input, check_wire_safe, template_renders_tools
from rest_proxy.ui import mount_ui

log = logging.getLogger(__name__)
_CREATED = int(time.time())


def create_app(config: ProxyConfig) -> FastAPI:
    metrics = ProxyMetrics()
    router = EngineRouter(config.engines, request_timeout=config.request_timeout,
                          on_grpc_error=metrics.record_grpc_error,
                          refresh_interval=config.engine_refresh_interval,
                          credentials=channel_credentials(config.engine_tls_ca, config.engine_tls_cert,
                                                          config.engine_tls_key),
                          api_key=config.engine_api_key)
    mcp = McpManager(config.mcp_servers, metrics=metrics, ping_interval=config.mcp_ping_interval,
                     max_backoff=config.mcp_max_backoff) if config.mcp_servers else None
    chat = ChatService(router, metrics=metrics, mcp=mcp, tool_parser=config.tool_parser,
                       reasoning_parser=config.reasoning_parser,
                       mcp_execute=config.mcp_execute, max_mcp_rounds=config.max_mcp_rounds)
    completions = CompletionService(router, metrics=metrics)
    responses = ResponsesService(chat, ResponseStore(config.responses_store_size, config.responses_store_ttl),
                                 metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        if mcp is not None:
            await mcp.start(wait=config.mcp_startup_wait)
        try:
            yield
        finally:
            if mcp is not None:
                await mcp.stop()
            await router.close()

    docs = {} if config.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="inference-service OpenAI-compatible proxy", version="0.1.0", lifespan=lifespan, **docs)
    app.state.config, app.state.metrics, app.state.router, app.state.mcp = config, metrics, router, mcp
    install_error_handlers(app)
    app.add_middleware(CancelOnDisconnectMiddleware)
    app.add_middleware(RequestBodyMiddleware, max_bytes=config.max_body_bytes, timeout=config.body_timeout)
    api_key_check = ApiKeyCheck(config.api_key)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.state.drain = DrainState()
    app.add_middleware(DrainMiddleware, state=app.state.drain)  # outermost: sees every request

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        plan = await chat.plan(req)
        if req.stream:
            return await event_stream(chat.stream(plan), metrics)
        return JSONResponse(await chat.complete(plan))

    app.state.responses_store = responses.store
    app.include_router(build_router(responses))

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest):
        if req.stream:
            return await event_stream(completions.stream(req), metrics)
        return JSONResponse(await completions.complete(req))

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest):
        client = await router.resolve(req.model)
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
        resp = await client.embed(request)
        data = []
        for i, emb in enumerate(resp.embeddings):
            values = list(emb.values)
            if req.encoding_format == "base64":
                values = base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": values})
        return {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": resp.prompt_tokens, "total_tokens": resp.prompt_tokens}}

    def model_card(info: pb.GetModelInfoResponse) -> dict:
        # NOTE: the file's name, never its path: where models live on the engines' disks is not the
        # clients' business.
        root = PurePath(info.model_path.rstrip("/\\")).name or info.model_name
        return {"id": info.model_name, "object": "model", "created": _CREATED, "owned_by": "inference-service",
                "root": root, "max_model_len": info.max_context_length}

    @app.get("/v1/models")
    async def list_models():
        await router.refresh_missing()
        models = router.models()
        if not models:  # not "no models": nothing to ask yet, as /health says
            raise router.unavailable()
        return {"object": "list", "data": [model_card(info) for info in models]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        return model_card((await router.resolve(model)).info)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        client = await router.resolve(req.model)
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

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        client = await router.resolve(req.model)
        request = pb.TokenizeRequest(detokenize=pb.DetokenizeIds(ids=req.tokens))
        if req.skip_special_tokens is not None:
            request.detokenize.skip_special_tokens = req.skip_special_tokens
        resp = await client.tokenize(request)
        return {"prompt": resp.text}

    @app.get("/health")
    async def health(request: Request, detail: bool = False):
        """200 `{"status": "ok"}` when every engine is SERVING, else 503 `{"status": "unavailable"}`. With
        `?detail=true` from a caller holding the API key (anyone when there is none): engines and MCP servers."""
        engines = []
        await router.refresh_missing()
        for client in router.clients:
            serving = await client.is_serving(timeout=2.0)
            engines.append({"target": client.target, "model": client.model_name, "serving": serving})
        ok = all(e["serving"] for e in engines)
        body = {"status": "ok" if ok else "unavailable"}
        if detail:
            if not api_key_check.is_authorized(request.scope):
                raise invalid_api_key()
            body["engines"] = engines
            body["mcp_servers"] = ({name: {"connected": c.client is not None, "tools": len(c.tools)}
                                    for name, c in mcp.connections.items()} if mcp is not None else {})
        return JSONResponse(body, status_code=200 if ok else 503)

    mount_ui(app, config)  # the chat UI at / when config.ui

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(_: Request):
        return metrics.render()

    return app


__all__ = ["ProxyError", "create_app"]
