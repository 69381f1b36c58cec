"""The gRPC servicer: multiplexes requests on streams and converts at the edges."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

from inference_service.api import pb, pb_grpc
from inference_service.convert import (
    chat_from_proto,
    delta_to_proto,
    embed_inputs_from_proto,
    embed_options_from_proto,
    embedding_result_to_proto,
    error_response,
    error_to_proto,
    prompt_from_proto,
    sampling_params_from_proto,
)
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.embedding_engine import EmbeddingEngine
from inference_service.engine.input_processor import InputProcessor
from inference_service.engine.request import EngineRequest
from inference_service.errors import EngineError, InvalidRequestError, UnimplementedError

logger = logging.getLogger(__name__)

_WAKE = object()  # wakes the response loop when a request or the reader ends


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, engine: AsyncEngine | None, model_name: str, embedder: EmbeddingEngine | None = None):
        """`engine` is None for an encoder model (Generate answers UNIMPLEMENTED); `embedder` serves Embed."""
        self.engine = engine
        self.llm = engine.engine if engine is not None else None
        self.embedder = embedder
        self.loaded = self.llm.loaded if self.llm is not None else embedder.loaded
        self.tokenizer = self.loaded.tokenizer
        self.model_name = model_name
        self.input_processor = self.llm.input_processor if self.llm is not None else InputProcessor(
            self.tokenizer, embedder.max_input_tokens, self.loaded.config.vocab_size)

    def _make_request(self, engine_request_id: str, start: pb.StartGeneration) -> EngineRequest:
        if self.llm is None:
            raise UnimplementedError(
                f"model {self.model_name!r} is an encoder ({self.loaded.config.model_type}) and serves only Embed "
                f"and Tokenize, not Generate")
        params = sampling_params_from_proto(start)
        add_special = start.add_special_tokens if start.HasField("add_special_tokens") else None
        return self.llm.input_processor.process(engine_request_id, prompt_from_proto(start), params, add_special)

    async def Generate(self, request_iterator, context) -> AsyncIterator[pb.GenerateResponse]:
        stream_id = uuid.uuid4().hex[:12]
        out: asyncio.Queue = asyncio.Queue()
        active: dict[str, asyncio.Task] = {}  # client request id -> task streaming its deltas

        async def stream_request(client_id: str, request: EngineRequest) -> None:
            num_deltas = 0
            try:
                async for delta in self.engine.generate(request):
                    num_deltas += 1
                    out.put_nowait(delta_to_proto(client_id, delta, self.tokenizer))
            except EngineError as e:
                if num_deltas == 0:  # refused before it ran (full queue, draining, bad format)
                    self.llm.metrics.on_request_rejected()
                out.put_nowait(error_response(client_id, e))
            finally:
                active.pop(client_id, None)
                out.put_nowait(_WAKE)

        def start(msg: pb.StartGeneration) -> None:
            client_id = msg.request_id
            if not client_id:
                raise InvalidRequestError("start.request_id must not be empty", field="start.request_id")
            if client_id in active:
                raise InvalidRequestError(
                    f"request id {client_id!r} is already running on this stream", field="start.request_id"
                )
            request = self._make_request(f"{stream_id}-{client_id}", msg)
            active[client_id] = asyncio.create_task(stream_request(client_id, request))

        async def read_requests() -> None:
            try:
                async for msg in request_iterator:
                    action = msg.WhichOneof("action")
                    client_id = msg.start.request_id if action == "start" else msg.cancel.request_id
                    try:
                        if action == "start":
                            start(msg.start)
                        elif action == "cancel":
                            if client_id not in active:
                                raise InvalidRequestError(
                                    f"cancel for unknown request id {client_id!r}", field="cancel.request_id"
                                )
                            self.engine.abort(f"{stream_id}-{client_id}")
                        else:
                            raise InvalidRequestError("the message sets neither start nor cancel", field="action")
                    except EngineError as e:
                        if action == "start" and self.llm is not None:
                            self.llm.metrics.on_request_rejected()
                        out.put_nowait(error_response(client_id, e))
            finally:
                out.put_nowait(_WAKE)

        async for item in _merge_responses(out, active, read_requests()):
            yield item

    async def Tokenize(self, request_iterator, context) -> AsyncIterator[pb.TokenizeResponse]:
        async for msg in request_iterator:
            try:
                yield self._tokenize(msg)
            except EngineError as e:
                yield pb.TokenizeResponse(request_id=msg.request_id, error=error_to_proto(e))

    def _tokenize(self, msg: pb.TokenizeRequest) -> pb.TokenizeResponse:
        tok = self.tokenizer
        response = pb.TokenizeResponse(request_id=msg.request_id)
        op = msg.WhichOneof("operation")
        if op == "tokenize":
            t = msg.tokenize
            add_special = t.add_special_tokens if t.HasField("add_special_tokens") else None
            response.token_ids.extend(tok.encode(t.text, add_special_tokens=add_special))
        elif op == "detokenize":
            d = msg.detokenize
            vocab = self.loaded.config.vocab_size
            bad = [i for i in d.ids if i >= vocab]
            if bad:
                raise InvalidRequestError(
                    f"detokenize.ids holds {bad[0]}, outside the vocabulary (size {vocab})", field="detokenize.ids"
                )
            skip = d.skip_special_tokens if d.HasField("skip_special_tokens") else True
            response.text = tok.decode(list(d.ids), skip_special_tokens=skip)
            return response
        elif op == "render_chat":
            response.text = self.input_processor.render_chat(chat_from_proto(msg.render_chat))
            response.token_ids.extend(tok.encode(response.text, add_special_tokens=False))
        else:
            raise InvalidRequestError("set one of tokenize, detokenize or render_chat", field="operation")
        response.tokens.extend(tok.convert_ids_to_tokens(list(response.token_ids)))
        return response

    async def Embed(self, request_iterator, context) -> AsyncIterator[pb.EmbedResponse]:
        if self.embedder is None:
            raise UnimplementedError(f"model {self.model_name!r} does not serve embeddings")
        out: asyncio.Queue = asyncio.Queue()
        active: dict[str, asyncio.Task] = {}  # client request id -> task computing its embeddings

        async def embed(msg: pb.EmbedRequest) -> None:
            try:
                result = await self.embedder.embed(embed_inputs_from_proto(msg), embed_options_from_proto(msg))
                out.put_nowait(embedding_result_to_proto(msg.request_id, result))
            except EngineError as e:
                out.put_nowait(pb.EmbedResponse(request_id=msg.request_id, error=error_to_proto(e)))
            finally:
                active.pop(msg.request_id, None)
                out.put_nowait(_WAKE)

        async def read_requests() -> None:
            try:
                async for msg in request_iterator:
                    if not msg.request_id or msg.request_id in active:
                        reason = "must not be empty" if not msg.request_id else "is already running on this stream"
                        error = InvalidRequestError(f"request_id {msg.request_id!r} {reason}", field="request_id")
                        out.put_nowait(pb.EmbedResponse(request_id=msg.request_id, error=error_to_proto(error)))
                        continue
                    active[msg.request_id] = asyncio.create_task(embed(msg))
            finally:
                out.put_nowait(_WAKE)

        async for item in _merge_responses(out, active, read_requests()):
            yield item

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        llm, tok, embedder = self.llm, self.tokenizer, self.embedder
        cfg = self.loaded.config
        special = pb.SpecialTokens(eos_token_ids=tok.eos_token_ids, bos_token=tok.bos_token or "",
                                   eos_token=tok.eos_token or "")
        if tok.bos_token_id is not None:
            special.bos_token_id = tok.bos_token_id
        if tok.pad_token_id is not None:
            special.pad_token_id = tok.pad_token_id
        response = pb.GetModelInfoResponse(
            model_name=self.model_name,
            family=cfg.model_type,
            architecture=cfg.architecture,
            max_context_length=llm.max_model_len if llm is not None else embedder.max_input_tokens,
            vocab_size=cfg.vocab_size,
            special_tokens=special,
            has_chat_template=tok.chat_template is not None,
            chat_template=tok.chat_template or "",
            supports_generate=llm is not None,
            supports_embed=embedder is not None,
            embedding_dimensions=embedder.embedding_dimensions if embedder is not None else 0,
            model_path=self.loaded.model_path,
        )
        if llm is None:
            return response
        sched = llm.config.scheduler
        response.kv_cache.CopyFrom(pb.KvCacheInfo(
            block_size=llm.block_manager.block_size,
            num_blocks=llm.block_manager.num_blocks,
            dtype=str(llm.dtype).removeprefix("torch."),
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            prefix_caching=llm.block_manager.enable_prefix_caching,
            device=str(llm.device),
        ))
        return response


async def _merge_responses(out: asyncio.Queue, active: dict[str, asyncio.Task], reader) -> AsyncIterator:
    """Yields what the request tasks put on `out` until the client stopped sending and every request ended.

    Leaving early (client gone, deadline) cancels the reader and every request task, which aborts
    their engine requests."""
    reader_task = asyncio.create_task(reader)
    try:
        while not (reader_task.done() and not active and out.empty()):
            item = await out.get()
            if item is not _WAKE:
                yield item
        await reader_task  # surfaces a failure of the request stream itself
    finally:
        reader_task.cancel()
        for task in list(active.values()):
            task.cancel()
