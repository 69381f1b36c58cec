"""The gRPC server: InferenceService, health, reflection, metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from inference_service.api import pb, pb_grpc
from inference_service.config import EngineConfig, ServerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.core_client import CoreClient
from inference_service.engine.embedding_engine import EmbeddingEngine, create_embedding_engine
from inference_service.engine.gc_heap import freeze_startup_heap
from inference_service.engine.info import ModelInfo
from inference_service.engine.input_processor import InputProcessor
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.model_loading import load_model_for, resolve_device
from inference_service.errors import InvalidRequestError, as_engine_error
from inference_service.ports import ensure_port_free
from inference_service.reflection import enable_reflection
from inference_service.security import ApiKeyInterceptor, server_credentials
from inference_service.servicer import InferenceServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place that maps exceptions to gRPC statuses (in-band errors go through `as_engine_error` too)."""
    error = as_engine_error(exc)
    return error.code, error.message


class _Undecodable:
    """Stands in for a request whose bytes are not a valid protobuf message."""

    def __init__(self, error: DecodeError):
        self.error = InvalidRequestError(f"the request is not a valid protobuf message: {error}")


def _tolerant(deserialize):
    # NOTE: grpc answers a deserializer's exception with INTERNAL/UNKNOWN; a client's bad bytes
    # are its own fault, so hand the handler a marker and let it answer INVALID_ARGUMENT.
    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as e:
            return _Undecodable(e)

    return parse if deserialize is not None else None


async def _checked(request_iterator):
    async for request in request_iterator:
        if isinstance(request, _Undecodable):
            raise request.error
        yield request


class ExceptionToStatusInterceptor(grpc.aio.ServerInterceptor):
    """Ends an InferenceService call that raised with the status `status_for` gives;
    undecodable request bytes end it with INVALID_ARGUMENT."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        if handler.unary_unary is not None:
            behavior = handler.unary_unary

            async def unary(request, context):
                try:
                    if isinstance(request, _Undecodable):
                        raise request.error
                    return await behavior(request, context)
                except Exception as e:  # noqa: BLE001 - mapped, never swallowed
                    await context.abort(*status_for(e))

            return grpc.unary_unary_rpc_method_handler(
                unary, _tolerant(handler.request_deserializer), handler.response_serializer
            )
        if handler.stream_stream is not None:
            stream_behavior = handler.stream_stream

            async def stream(request_iterator, context):
                try:
                    async for response in stream_behavior(_checked(request_iterator), context):
                        yield response
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as e:  # noqa: BLE001
                    await context.abort(*status_for(e))

            return grpc.stream_stream_rpc_method_handler(
                stream, _tolerant(handler.request_deserializer), handler.response_serializer
            )
        return handler


def _core_in_process(engine_config: EngineConfig, server_config: ServerConfig) -> bool:
    """Where the engine core runs: as configured, else in a process of its own except on the CPU.

    NOTE: why not on the CPU: on the 2-core CPU machine the split made the embedded model's batch-1 decode
    0.62x of in-process (69 vs 111 tok/s; 16 concurrent 198 vs 330; bench/core_split.py, 2026-11-25): the
    front end's process takes a core from the CPU kernels' threads. Tensor parallelism keeps it in process
    too (its worker ranks report to rank 0's process)."""
    if engine_config.tensor_parallel_size > 1:
        return True
    if server_config.engine_in_process is not None:
        return server_config.engine_in_process
    return resolve_device(engine_config.device).type == "cpu"


class EngineServer:
    """Owns the engines and the gRPC server; `start()`, then `wait_for_shutdown()`.

    By default the engine core runs in a process of its own (`core`, a `CoreClient`, is then the
    `async_engine`). With `server_config.engine_in_process`, or an `llm_engine` given, the synchronous
    generation engine is loaded here (an encoder model has none) and `async_engine` runs it on a thread.
    `embedder` serves Embed."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig,
                 llm_engine: LLMEngine | None = None):
        self.server_config = server_config
        self.exit_code = 0  # 1 once the engine core or a tensor-parallel worker died
        self.failure: str | None = None  # what died, when something did
        self.core: CoreClient | None = None
        # Tensor parallelism: the worker ranks rank 0 started (`distributed/workers.py`); one that dies
        # stops the server (NOT_SERVING, then a non-zero exit). NOTE: rank 0 runs in this process for now
        # (its workers report here), so tensor parallelism keeps the engine core in process.
        self.tp_workers = self._tp_driver = None
        if llm_engine is None and not _core_in_process(engine_config, server_config):
            self._init_core_process(engine_config)
        else:
            self._init_in_process(engine_config, llm_engine)
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self._shutdown = asyncio.Event()
        mib = server_config.max_message_mib * 2**20
        keepalive_ms = int(server_config.keepalive_time_s * 1000)
        # The key check comes first: a call without the key never reaches the servicer.
        auth = [ApiKeyInterceptor(server_config.api_key)] if server_config.api_key else []
        self.server = grpc.aio.server(
            interceptors=[*auth, ExceptionToStatusInterceptor()],
            options=[
                # NOTE: gRPC sets SO_REUSEPORT by default, so a second engine on a taken port would start
                # and the kernel would split connections between the two; off, the second one fails to bind.
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", mib),
                ("grpc.max_send_message_length", mib),
                ("grpc.keepalive_time_ms", keepalive_ms),
                ("grpc.keepalive_timeout_ms", 10_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        self.servicer = InferenceServicer(self.model, self.input_processor, self.async_engine, self.embedder,
                                          max_stream_stall_s=server_config.max_stream_stall_s,
                                          max_queued_responses=server_config.max_queued_responses)
        pb_grpc.add_InferenceServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection([SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], self.server)

    def _init_core_process(self, engine_config: EngineConfig) -> None:
        """The engine core in its own process; this one keeps gRPC, tokenization and streaming."""
        log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.core = core = CoreClient.spawn(engine_config, log_level)
        core.on_core_died = self._on_core_died
        ready = core.ready
        self.model = ready.model
        self.async_engine = core if ready.info is not None else None
        self.embedder = EmbeddingEngine(ready.embedding, max_input_tokens=ready.max_embed_input_tokens,
                                        generation_engine=core)
        # Stopped in this order: the embedder's batches run in the core.
        self.engines = [self.embedder, core]
        max_len = ready.info.max_model_len if ready.info is not None else ready.max_embed_input_tokens
        self.input_processor = InputProcessor(ready.tokenizer, max_len, ready.model.vocab_size)

    def _init_in_process(self, engine_config: EngineConfig, llm_engine: LLMEngine | None) -> None:
        """The engine core on a thread of this process (`--engine-in-process`, or an engine given)."""
        if llm_engine is None:
            on_device = load_model_for(engine_config)
            loaded, device, dtype = on_device.loaded, on_device.device, on_device.dtype
            # An encoder (BERT) only embeds: no KV cache, no generation engine.
            llm_engine = None if loaded.is_encoder else LLMEngine(engine_config, loaded=loaded)
        else:
            loaded, device, dtype = llm_engine.loaded, llm_engine.device, llm_engine.dtype
        self.llm_engine = llm_engine
        self.tp_workers = getattr(loaded.model, "workers", None)
        self._tp_driver = loaded.model if self.tp_workers is not None else None
        self.model = ModelInfo.of(loaded, engine_config.served_model_name, device, dtype)
        self.async_engine = AsyncEngine(llm_engine) if llm_engine is not None else None
        self.embedder = create_embedding_engine(
            loaded, device=device, dtype=dtype, pooling_mode=engine_config.embedding_pooling,
            max_model_len=llm_engine.max_model_len if llm_engine is not None else engine_config.max_model_len,
            block_size=engine_config.cache.block_size, generation_engine=self.async_engine)
        # Stopped in this order: a decoder's embeddings run on the generation engine's thread.
        self.engines = [e for e in (self.embedder, self.async_engine) if e is not None]
        self.input_processor = (llm_engine.input_processor if llm_engine is not None else
                                InputProcessor(loaded.tokenizer, self.embedder.max_input_tokens, self.model.vocab_size))

    def _on_core_died(self) -> None:
        """NOT_SERVING at once (before the drain, which finds nothing left), then down with exit code 1."""
        self.exit_code = 1
        self._not_serving_task = asyncio.get_running_loop().create_task(self._set_not_serving())
        self.request_shutdown()

    async def _set_not_serving(self) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def start(self) -> int:
        cfg = self.server_config
        if self.tp_workers is not None:
            loop = asyncio.get_running_loop()
            self.tp_workers.on_failure = lambda message: loop.call_soon_threadsafe(self._fail, message)
        for engine in self.engines:
            engine.start()
        address, credentials = f"{cfg.host}:{cfg.port}", server_credentials(cfg)
        try:
            self.port = (self.server.add_secure_port(address, credentials) if credentials is not None
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # grpc says only "Failed to bind"; the usual cause is a taken port
            self.port = 0
        if self.port == 0:
            ensure_port_free(cfg.host, cfg.port)
            raise OSError(f"cannot listen on {address}")
        await self.server.start()
        if cfg.metrics_port is not None:
            start_http_server(cfg.metrics_port, addr=cfg.host)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving %s on %s:%d", self.model.name, cfg.host, self.port)
        return self.port

    def request_shutdown(self) -> None:
        self._shutdown.set()

    def _fail(self, message: str) -> None:
        """A part the server cannot run without is gone: NOT_SERVING at once, then down, exit code 1."""
        self.failure = message
        self._on_core_died()

    async def wait_for_shutdown(self) -> None:
        await self._shutdown.wait()
        await self.shutdown()

    async def shutdown(self) -> None:
        """Drains: NOT_SERVING first, no new requests, in-flight ones get `shutdown_timeout`, then stops."""
        timeout = self.server_config.shutdown_timeout
        def num_active() -> int:
            return sum(engine.num_active_requests for engine in self.engines)

        logger.info("shutting down: draining %d requests (up to %.0fs)", num_active(), timeout)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        for engine in self.engines:
            engine.is_draining = True
        deadline = time.monotonic() + timeout
        while num_active() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for engine in self.engines:
            await engine.stop()  # aborts whatever did not finish in time
        await self.server.stop(grace=1.0)
        if self.tp_workers is not None:
            await asyncio.to_thread(self.tp_workers.stop, self._tp_driver)
        logger.info("shut down")


async def serve(engine_config: EngineConfig, server_config: ServerConfig,
                on_started: Callable[[EngineServer], Awaitable[None]] | None = None) -> int:
    """Runs the server until SIGTERM or SIGINT (or the engine core's death), then shuts down gracefully;
    returns the process's exit code: 0, or 1 when the engine core died."""
    # Before loading the model, which can take minutes: a taken port fails now.
    ensure_port_free(server_config.host, server_config.port)
    if server_config.metrics_port is not None:
        ensure_port_free(server_config.host, server_config.metrics_port)
    server = EngineServer(engine_config, server_config)
    # One server a process: nothing frozen here is ever dropped. Before serving, so that the
    # collection this does delays no request.
    freeze_startup_heap()
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_shutdown)
    if on_started is not None:
        await on_started(server)
    await server.wait_for_shutdown()
    if server.failure is not None:
        logger.error("stopped after a failure: %s", server.failure)
    return server.exit_code
