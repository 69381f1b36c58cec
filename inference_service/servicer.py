"""The gRPC servicer: multiplexes requests on streams and converts at the edges."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from inference_service.api import pb, pb_grpc
from inference_service.convert import (
    chat_from_proto,
    delta_to_proto,
    embed_inputs_from_proto,
    embed_options_from_proto,
    embedding_result_to_proto,
    error_response,
    error_to_proto,
    generation_defaults_to_proto,
    prompt_from_proto,
    sampling_params_from_proto,
)
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.embedding_engine import EmbeddingEngine
from inference_service.engine.info import ModelInfo
from inference_service.engine.input_processor import InputProcessor
from inference_service.engine.request import CompletionDelta, EngineRequest, Usage
from inference_service.engine.sequence import FinishReason
from inference_service import ENGINE_VERSION
from inference_service.errors import InvalidRequestError, ResourceExhaustedError, UnimplementedError, as_engine_error
from inference_service.stream_output import ResponseQueue

logger = logging.getLogger(__name__)

_NUM_TOKENIZER_THREADS = 4
# Up to these sizes a request is prepared on the event loop: the tokenizer threads' hop (two thread switches,
# ~0.1-0.5 ms of the first token) costs more than the work. Token ids are checked at C speed (~8k: ~0.2 ms).
_MAX_INLINE_TOKEN_IDS = 8192
_MAX_INLINE_BYTES = 1024


def _is_quick_to_prepare(start: pb.StartGeneration) -> bool:
    if start.WhichOneof("input") == "token_ids":
        return len(start.token_ids.ids) <= _MAX_INLINE_TOKEN_IDS
    return start.ByteSize() <= _MAX_INLINE_BYTES


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, model: ModelInfo, input_processor: InputProcessor, async_engine: AsyncEngine | None,
                 embedder: EmbeddingEngine | None = None, *, max_stream_stall_s: float = float("inf"),
                 max_queued_responses: int | None = None):
        """`async_engine` is None for an encoder model (Generate answers UNIMPLEMENTED); `embedder` serves Embed.
        A Generate stream whose client does not read for `max_stream_stall_s` seconds, or lets more than
        `max_queued_responses` responses wait, gets its requests aborted with RESOURCE_EXHAUSTED."""
        self.max_stream_stall_s = max_stream_stall_s
        self.max_queued_responses = max_queued_responses
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(_NUM_TOKENIZER_THREADS, "tokenize")
        self.model = model
        self.async_engine = async_engine
        self.embedder = embedder
        self.input_processor = input_processor
        self.tokenizer = input_processor.tokenizer

    def _make_request(self, engine_request_id: str, start: pb.StartGeneration) -> EngineRequest:
        if self.async_engine is None:
            raise UnimplementedError(
                f"model {self.model.name!r} is an encoder ({self.model.family}) and serves only Embed "
                f"and Tokenize, not Generate")
        params = sampling_params_from_proto(start, self.async_engine.info().generation_defaults)
        add_special = start.add_special_tokens if start.HasField("add_special_tokens") else None
        return self.input_processor.process(engine_request_id, prompt_from_proto(start), params, add_special,
                                            start.priority)

    def _count_rejected(self) -> None:
        if self.async_engine is not None:  # an encoder has no generation metrics
            self.async_engine.count_rejected()

    async def _off_loop(self, fn, *args):
        """Runs `fn(*args)` on the tokenizer threads: a long prompt must not stall every other stream."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def Generate(self, request_iterator, context) -> AsyncIterator[pb.GenerateResponse]:
        stream_id = uuid.uuid4().hex[:12]
        out = ResponseQueue(self.max_stream_stall_s, self.max_queued_responses)
        active: dict[str, asyncio.Task] = {}  # client request id -> task running it
        in_engine: set[str] = set()  # of those, the ones handed to the engine (cancel aborts them there)
        cancelled: set[str] = set()  # cancelled before they reached the engine

        async def run(client_id: str, msg: pb.StartGeneration) -> None:
            engine_id = f"{stream_id}-{client_id}"
            num_deltas = 0
            try:
                if _is_quick_to_prepare(msg):
                    request = self._make_request(engine_id, msg)
                else:
                    request = await self._off_loop(self._make_request, engine_id, msg)
                if client_id in cancelled:
                    out.put(delta_to_proto(client_id, aborted_before_start(request), self.tokenizer))
                    return
                in_engine.add(client_id)
                async with aclosing(self.async_engine.generate(request)) as deltas:
                    async for delta in deltas:
                        stall = out.stall_reason()
                        if stall is not None:  # leaving the loop aborts the request and frees its blocks
                            raise ResourceExhaustedError(f"request aborted: {stall}")
                        num_deltas += 1
                        out.put(delta_to_proto(client_id, delta, self.tokenizer))
            except Exception as e:  # noqa: BLE001 - one request's failure ends that request, never the stream
                if num_deltas == 0:  # refused before it ran (bad input, full queue, draining, bad format)
                    self._count_rejected()
                out.put(error_response(client_id, as_engine_error(e)))
            finally:
                active.pop(client_id, None)
                in_engine.discard(client_id)
                cancelled.discard(client_id)
                out.wake()

        def start(msg: pb.StartGeneration) -> None:
            client_id = msg.request_id
            if not client_id:
                raise InvalidRequestError("start.request_id must not be empty", field="start.request_id")
            if client_id in active:
                raise InvalidRequestError(
                    f"request id {client_id!r} is already running on this stream", field="start.request_id"
                )
            active[client_id] = asyncio.create_task(run(client_id, msg))

        def cancel(client_id: str) -> None:
            if client_id not in active:
                raise InvalidRequestError(f"cancel for unknown request id {client_id!r}", field="cancel.request_id")
            if client_id in in_engine:
                self.async_engine.abort(f"{stream_id}-{client_id}")
            else:
                cancelled.add(client_id)

        async def read_requests() -> None:
            try:
                async for msg in request_iterator:
                    action = msg.WhichOneof("action")
                    client_id = msg.start.request_id if action == "start" else msg.cancel.request_id
                    try:
                        if action == "start":
                            start(msg.start)
                        elif action == "cancel":
                            cancel(client_id)
                        else:
                            raise InvalidRequestError("the message sets neither start nor cancel", field="action")
                    except Exception as e:  # noqa: BLE001 - answered in-band; the stream carries on
                        if action == "start":
                            self._count_rejected()
                        out.put(error_response(client_id, as_engine_error(e)))
            finally:
                out.wake()

        async for item in out.responses(active, read_requests()):
            yield item

    async def Tokenize(self, request_iterator, context) -> AsyncIterator[pb.TokenizeResponse]:
        async for msg in request_iterator:
            try:
                yield await self._off_loop(self._tokenize, msg)
            except Exception as e:  # noqa: BLE001 - answered in-band; the stream carries on
                yield pb.TokenizeResponse(request_id=msg.request_id, error=error_to_proto(as_engine_error(e)))

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
            vocab = self.model.vocab_size
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
            raise UnimplementedError(f"model {self.model.name!r} does not serve embeddings")
        out = ResponseQueue()
        active: dict[str, asyncio.Task] = {}  # client request id -> task computing its embeddings

        async def embed(msg: pb.EmbedRequest) -> None:
            try:
                result = await self.embedder.embed(embed_inputs_from_proto(msg), embed_options_from_proto(msg))
                out.put(embedding_result_to_proto(msg.request_id, result))
            except Exception as e:  # noqa: BLE001 - answered in-band; the stream carries on
                out.put(pb.EmbedResponse(request_id=msg.request_id, error=error_to_proto(as_engine_error(e))))
            finally:
                active.pop(msg.request_id, None)
                out.wake()

        async def read_requests() -> None:
            try:
                async for msg in request_iterator:
                    if not msg.request_id or msg.request_id in active:
                        reason = "must not be empty" if not msg.request_id else "is already running on this stream"
                        error = InvalidRequestError(f"request_id {msg.request_id!r} {reason}", field="request_id")
                        out.put(pb.EmbedResponse(request_id=msg.request_id, error=error_to_proto(error)))
                        continue
                    active[msg.request_id] = asyncio.create_task(embed(msg))
            finally:
                out.wake()

        async for item in out.responses(active, read_requests()):
            yield item

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        model, tok, embedder = self.model, self.tokenizer, self.embedder
        info = self.async_engine.info() if self.async_engine is not None else None
        special = pb.SpecialTokens(eos_token_ids=tok.eos_token_ids, bos_token=tok.bos_token or "",
                                   eos_token=tok.eos_token or "")
        if tok.bos_token_id is not None:
            special.bos_token_id = tok.bos_token_id
        if tok.pad_token_id is not None:
            special.pad_token_id = tok.pad_token_id
        response = pb.GetModelInfoResponse(
            model_name=model.name,
            family=model.family,
            architecture=model.architecture,
            max_context_length=info.max_model_len if info is not None else embedder.max_input_tokens,
            vocab_size=model.vocab_size,
            special_tokens=special,
            has_chat_template=tok.chat_template is not None,
            chat_template=tok.chat_template or "",
            supports_generate=info is not None,
            supports_embed=embedder is not None,
            embedding_dimensions=embedder.embedding_dimensions if embedder is not None else 0,
            model_path=model.model_path,
            engine_version=ENGINE_VERSION,
            quantization=model.quantization,
            quantization_bits=model.quantization_bits,
            weight_bytes=model.weight_bytes,
        )
        if info is None:
            return response
        response.generation_defaults.CopyFrom(generation_defaults_to_proto(info.generation_defaults))
        response.scheduling_policy = info.scheduling_policy
        response.kv_cache.CopyFrom(pb.KvCacheInfo(
            block_size=info.block_size,
            num_blocks=info.num_blocks,
            dtype=model.dtype,
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_waiting_requests=info.max_waiting_requests,
            prefix_caching=info.enable_prefix_caching,
            device=model.device,
        ))
        return response


def aborted_before_start(request: EngineRequest) -> CompletionDelta:
    """The last delta of a request cancelled before it reached the engine."""
    return CompletionDelta(request.request_id, 0, [], "", finish_reason=FinishReason.ABORT,
                           usage=Usage(len(request.prompt_token_ids), 0, 0))
