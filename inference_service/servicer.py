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
    error_response,
    error_to_proto,
    prompt_from_proto,
    sampling_params_from_proto,
)
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.request import EngineRequest
from inference_service.errors import EngineError, InvalidRequestError, UnimplementedError

logger = logging.getLogger(__name__)

_WAKE = object()  # wakes the response loop when a request or the reader ends


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.llm = engine.engine
        self.tokenizer = self.llm.tokenizer
        self.model_name = model_name

    def _make_request(self, engine_request_id: str, start: pb.StartGeneration) -> EngineRequest:
        params = sampling_params_from_proto(start)
        add_special = start.add_special_tokens if start.HasField("add_special_tokens") else None
        return self.llm.input_processor.process(engine_request_id, prompt_from_proto(start), params, add_special)

    async def Generate(self, request_iterator, context) -> AsyncIterator[pb.GenerateResponse]:
        stream_id = uuid.uuid4().hex[:12]
        out: asyncio.Queue = asyncio.Queue()
        active: dict[str, asyncio.Task] = {}  # client request id -> task streaming its deltas

        async def stream_request(client_id: str, request: EngineRequest) -> None:
            try:
                async for delta in self.engine.generate(request):
                    out.put_nowait(delta_to_proto(client_id, delta, self.tokenizer))
            except EngineError as e:
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
                        out.put_nowait(error_response(client_id, e))
            finally:
                out.put_nowait(_WAKE)

        reader = asyncio.create_task(read_requests())
        try:
            while not (reader.done() and not active and out.empty()):
                item = await out.get()
                if item is not _WAKE:
                    yield item
            await reader  # surfaces a failure of the request stream itself
        finally:
            reader.cancel()
            for task in list(active.values()):
                task.cancel()

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
            vocab = self.llm.loaded.config.vocab_size
            bad = [i for i in d.ids if i >= vocab]
            if bad:
                raise InvalidRequestError(
                    f"detokenize.ids holds {bad[0]}, outside the vocabulary (size {vocab})", field="detokenize.ids"
                )
            skip = d.skip_special_tokens if d.HasField("skip_special_tokens") else True
            response.text = tok.decode(list(d.ids), skip_special_tokens=skip)
            return response
        elif op == "render_chat":
            response.text = self.llm.input_processor.render_chat(chat_from_proto(msg.render_chat))
            response.token_ids.extend(tok.encode(response.text, add_special_tokens=False))
        else:
            raise InvalidRequestError("set one of tokenize, detokenize or render_chat", field="operation")
        response.tokens.extend(tok.convert_ids_to_tokens(list(response.token_ids)))
        return response

    async def Embed(self, request_iterator, context) -> AsyncIterator[pb.EmbedResponse]:
        raise UnimplementedError(f"model {self.model_name!r} is generative and does not serve embeddings")
        yield  # pragma: no cover - makes this an async generator like the other streams

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        llm, tok = self.llm, self.tokenizer
        cfg = llm.loaded.config
        special = pb.SpecialTokens(eos_token_ids=tok.eos_token_ids, bos_token=tok.bos_token or "",
                                   eos_token=tok.eos_token or "")
        if tok.bos_token_id is not None:
            special.bos_token_id = tok.bos_token_id
        if tok.pad_token_id is not None:
            special.pad_token_id = tok.pad_token_id
        sched = llm.config.scheduler
        return pb.GetModelInfoResponse(
            model_name=self.model_name,
            family=cfg.model_type,
            architecture=cfg.architecture,
            max_context_length=llm.max_model_len,
            vocab_size=cfg.vocab_size,
            special_tokens=special,
            has_chat_template=tok.chat_template is not None,
            chat_template=tok.chat_template or "",
            kv_cache=pb.KvCacheInfo(
                block_size=llm.block_manager.block_size,
                num_blocks=llm.block_manager.num_blocks,
                dtype=str(llm.dtype).removeprefix("torch."),
                max_num_seqs=sched.max_num_seqs,
                max_num_batched_tokens=sched.max_num_batched_tokens,
                prefix_caching=llm.block_manager.enable_prefix_caching,
                device=str(llm.device),
            ),
            supports_generate=True,
            supports_embed=False,
            model_path=llm.loaded.model_path,
        )

