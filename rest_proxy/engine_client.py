"""Long-lived aio gRPC channels to the engines, and routing of requests by model name."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable

import anyio
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_service.api import pb, pb_grpc
from rest_proxy.engine_auth import bearer_token_interceptors
from rest_proxy.errors import ProxyError, from_engine_error, from_rpc_error, grpc_code_name

log = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # NOTE: reconnect within a second of a restarted engine coming back; gRPC's default backoff
    # grows to 120 s, which would keep answering 503 long after the engine is up again.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

_UNREACHABLE = (503, 504)  # how a GetModelInfo to an engine that is away (or still starting) fails


class EngineClient:
    """One engine target: a shared channel, its model description, and one call per operation."""

    def __init__(self, target: str, *, request_timeout: float | None = None,
                 on_grpc_error: Callable[[str], None] | None = None,
                 credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None):
        self.target = target
        self.request_timeout = request_timeout
        self._credentials = credentials  # None: plaintext
        self._interceptors = bearer_token_interceptors(api_key) if api_key else None
        self.info: pb.GetModelInfoResponse | None = None
        self.last_refresh_error: ProxyError | None = None  # why the last GetModelInfo failed
        self._on_grpc_error = on_grpc_error or (lambda _code: None)
        self.channel: grpc.aio.Channel | None = None

    def connect(self) -> None:
        """Open the channel; it belongs to the running event loop, so this runs inside it."""
        if self._credentials is not None:
            self.channel = grpc.aio.secure_channel(self.target, self._credentials, options=_CHANNEL_OPTIONS,
                                                   interceptors=self._interceptors)
        else:
            self.channel = grpc.aio.insecure_channel(self.target, options=_CHANNEL_OPTIONS,
                                                     interceptors=self._interceptors)
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def model_name(self) -> str | None:
        return self.info.model_name if self.info is not None else None

    def _error(self, err: grpc.aio.AioRpcError) -> ProxyError:
        self._on_grpc_error(err.code().name)
        return from_rpc_error(err, self.target)

    def _inband_error(self, error: pb.Error) -> ProxyError:
        self._on_grpc_error(grpc_code_name(error.code))
        return from_engine_error(error.code, error.message, error.field)

    async def refresh_info(self, timeout: float = 2.0) -> pb.GetModelInfoResponse:
        try:
            # wait_for_ready: an engine that just came up is reached once the channel reconnects.
            self.info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.aio.AioRpcError as err:
            # NOTE: not counted in rest_proxy_grpc_errors_total: this polls every second while an engine
            # is away, which would drown the errors of real requests.
            raise from_rpc_error(err, self.target) from None
        return self.info

    async def is_serving(self, timeout: float = 2.0) -> bool:
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def generate(self, start: pb.StartGeneration) -> AsyncIterator[pb.GenerateResponse]:
        """Run one request on its own Generate stream, yielding its responses up to its last one.

        In-band errors raise `ProxyError`. Leaving the iteration early (the client went away) sends
        `CancelGeneration` and cancels the call, which aborts the engine request.
        """
        if not start.request_id:
            start.request_id = uuid.uuid4().hex
        num_completions = max(start.n, 1)
        call = self.stub.Generate(timeout=self.request_timeout)
        finished: set[int] = set()
        done = False
        try:
            await call.write(pb.GenerateRequest(start=start))
            reader = call.__aiter__()
            while True:
                try:
                    if len(finished) >= num_completions:
                        # Everything finished but no usage yet: give it a moment, then stop.
                        resp = await asyncio.wait_for(reader.__anext__(), timeout=1.0)
                    else:
                        resp = await reader.__anext__()
                except (StopAsyncIteration, asyncio.TimeoutError):
                    done = True
                    return
                if resp.request_id and resp.request_id != start.request_id:
                    continue
                if resp.HasField("error") and (resp.error.code or resp.error.message):
                    done = True
                    raise self._inband_error(resp.error)
                if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    finished.add(resp.index)
                yield resp
                if resp.HasField("usage"):
                    done = True
                    return
        except grpc.aio.AioRpcError as err:
            done = True
            raise self._error(err) from None
        finally:
            if not done and not call.done():
                # NOTE: a cancelled read already cancels the call; otherwise (the consumer just
                # stopped) say so in-band first. Shielded: the caller may be in a cancelled scope.
                with contextlib.suppress(Exception), anyio.move_on_after(0.2, shield=True):
                    await call.write(pb.GenerateRequest(cancel=pb.CancelGeneration(request_id=start.request_id)))
            call.cancel()

    async def generate_many(self, starts: list[pb.StartGeneration]) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        """Run requests multiplexed on one Generate stream, yielding (position in `starts`, response) as
        responses arrive, each request's up to its last one.

        One stream however many requests: thousands of streams at once on the shared channel break gRPC
        core, and the engine takes every request of a stream the same way. An in-band error of any request
        raises `ProxyError`; leaving the iteration early cancels the call, which aborts every request."""
        positions: dict[str, int] = {}
        for position, start in enumerate(starts):
            start.request_id = start.request_id or uuid.uuid4().hex
            positions[start.request_id] = position
        finished: dict[str, set[int]] = {request_id: set() for request_id in positions}
        num_unfinished = sum(max(start.n, 1) for start in starts)  # completions without a finish reason
        remaining = set(positions)  # requests without their usage (their last response)
        call = self.stub.Generate(timeout=self.request_timeout)
        try:
            for start in starts:
                await call.write(pb.GenerateRequest(start=start))
            await call.done_writing()
            reader = call.__aiter__()
            while remaining:
                try:
                    if num_unfinished:
                        resp = await reader.__anext__()
                    else:  # everything finished but some usage is missing: give it a moment, then stop
                        resp = await asyncio.wait_for(reader.__anext__(), timeout=1.0)
                except (StopAsyncIteration, asyncio.TimeoutError):
                    return
                position = positions.get(resp.request_id)
                if position is None:
                    continue
                if resp.HasField("error") and (resp.error.code or resp.error.message):
                    raise self._inband_error(resp.error)
                if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED and resp.index not in finished[resp.request_id]:
                    finished[resp.request_id].add(resp.index)
                    num_unfinished -= 1
                yield position, resp
                if resp.HasField("usage"):
                    remaining.discard(resp.request_id)
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        finally:
            call.cancel()

    async def _unary_stream(self, method, request, error_field: str):
        call = method(timeout=self.request_timeout)
        try:
            await call.write(request)
            await call.done_writing()
            async for resp in call:
                if resp.request_id == request.request_id:
                    if resp.HasField(error_field) and (getattr(resp, error_field).code
                                                       or getattr(resp, error_field).message):
                        raise self._inband_error(getattr(resp, error_field))
                    return resp
        except grpc.aio.AioRpcError as err:
            raise self._error(err) from None
        finally:
            call.cancel()
        raise ProxyError(502, f"engine at {self.target} closed the stream without an answer",
                         type="server_error", code="bad_gateway")

    async def embed(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        request.request_id = request.request_id or uuid.uuid4().hex
        return await self._unary_stream(self.stub.Embed, request, "error")

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        request.request_id = request.request_id or uuid.uuid4().hex
        return await self._unary_stream(self.stub.Tokenize, request, "error")

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close(grace=None)


class EngineRouter:
    """Routes a request to the engine serving its `model` (names from `GetModelInfo`)."""

    def __init__(self, targets: list[str], *, request_timeout: float | None = None,
                 on_grpc_error: Callable[[str], None] | None = None, refresh_interval: float = 1.0,
                 credentials: grpc.ChannelCredentials | None = None, api_key: str | None = None):
        if not targets:
            raise ValueError("at least one engine target is required")
        self.clients = [EngineClient(t, request_timeout=request_timeout, on_grpc_error=on_grpc_error,
                                     credentials=credentials, api_key=api_key)
                        for t in targets]
        self._refresh_interval = refresh_interval
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        for client in self.clients:
            client.connect()
        await asyncio.gather(*(self._try_refresh(c) for c in self.clients))
        self._task = asyncio.create_task(self._refresh_loop())

    async def _try_refresh(self, client: EngineClient, timeout: float = 2.0) -> bool:
        try:
            await client.refresh_info(timeout=timeout)
            client.last_refresh_error = None
            return True
        except ProxyError as err:
            last = client.last_refresh_error
            if err.status not in _UNREACHABLE and (last is None or err.message != last.message):  # once, not every second
                log.warning("cannot describe the model of %s: %s", client.target, err.message)
            client.last_refresh_error = err
            return False

    async def _refresh_loop(self) -> None:
        # NOTE: engines may start after the proxy; keep asking until each has described its model.
        while True:
            await asyncio.sleep(self._refresh_interval)
            missing = [c for c in self.clients if c.info is None]
            if missing:
                await asyncio.gather(*(self._try_refresh(c) for c in missing))

    async def refresh_missing(self, timeout: float = 1.0) -> None:
        """Ask engines that have not described their model yet (they may have just come up)."""
        unknown = [c for c in self.clients if c.info is None]
        if unknown:
            await asyncio.gather(*(self._try_refresh(c, timeout=timeout) for c in unknown))

    def models(self) -> list[pb.GetModelInfoResponse]:
        return [c.info for c in self.clients if c.info is not None]

    async def resolve(self, model: str) -> EngineClient:
        for client in self.clients:
            if client.model_name == model:
                return client
        unknown = [c for c in self.clients if c.info is None]
        if unknown:
            await self.refresh_missing()
            for client in unknown:
                if client.model_name == model:
                    return client
            if all(c.info is None for c in self.clients):
                raise self.unavailable()
        served = ", ".join(sorted(m.model_name for m in self.models()))
        raise ProxyError(404, f"The model `{model}` does not exist. Served models: {served}",
                         type="invalid_request_error", param="model", code="model_not_found")

    def unavailable(self) -> ProxyError:
        """The error while no engine has described its model yet: an engine that answers but refuses
        (a wrong --engine-api-key) says so; otherwise none is reachable."""
        refusals = [c.last_refresh_error for c in self.clients
                    if c.last_refresh_error is not None and c.last_refresh_error.status not in _UNREACHABLE]
        if refusals:
            return refusals[0]
        targets = ", ".join(c.target for c in self.clients)
        return ProxyError(503, f"no engine reachable ({targets})", type="service_unavailable",
                          code="engine_unavailable")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
