"""Clients that send one request and time its stream: the engine over gRPC, the proxy over OpenAI HTTP.

Both fill a `RequestRecord`. A request succeeds only if its stream ends properly (gRPC: the message
with usage; HTTP: `data: [DONE]`) with finish reason stop or length. Anything else is an error of
a named kind, so a stream cut short is never counted as a short, successful answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import grpc
import httpx

from inference_service.api import pb, pb_grpc
from loadtest.workload import RequestSpec

_GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.max_send_message_length", 64 * 2**20)]
_GRPC_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_ERROR: "error"}


@dataclass(slots=True)
class RequestRecord:
    """Timings of one request, in seconds on the benchmark's clock (`time.perf_counter()`)."""

    index: int
    start: float = 0.0  # when the request was sent
    end: float = 0.0  # when its stream ended (either way)
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks carrying output
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error_kind: str | None = None  # None: success
    error: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # gRPC only

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def fail(self, kind: str, message: str = "") -> None:
        if self.error_kind is None:  # keep the first cause
            self.error_kind, self.error = kind, message[:300]

    def chunk(self, now: float, text: str = "", token_ids=()) -> None:
        self.chunk_times.append(now)
        self.text += text
        self.token_ids.extend(token_ids)

    def finish(self, now: float, completed: bool) -> None:
        self.end = now
        if not self.output_tokens and self.token_ids:
            self.output_tokens = len(self.token_ids)
        if not completed:
            self.fail("truncated", "the stream ended before the request's final message")
        elif self.finish_reason not in ("stop", "length"):
            self.fail(f"finish_{self.finish_reason}", f"finish reason {self.finish_reason}")


class GrpcBackend:
    """The engine's `Generate` RPC, one bidi stream per request (like independent clients)."""

    name = "grpc"

    def __init__(self, target: str, *, timeout: float | None = None, temperature: float = 0.0):
        self.target, self.timeout, self.temperature = target, timeout, temperature
        self.channel: grpc.aio.Channel | None = None

    async def open(self) -> str:
        """Connects and returns the served model's name."""
        self.channel = grpc.aio.insecure_channel(self.target, options=_GRPC_OPTIONS)
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        return info.model_name

    def _start(self, spec: RequestSpec) -> pb.StartGeneration:
        start = pb.StartGeneration(
            request_id=f"lt-{spec.index}", sampling=pb.SamplingParams(temperature=self.temperature),
            stopping=pb.StoppingCriteria(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos))
        if spec.prompt_token_ids is not None:
            start.token_ids.ids.extend(spec.prompt_token_ids)
        elif spec.prompt is not None:
            start.text = spec.prompt
        else:
            start.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m.get("content") or "")
                                       for m in spec.messages)
        return start

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> None:
        call = self.stub.Generate(timeout=self.timeout)
        completed = False
        rec.start = time.perf_counter()
        try:
            await call.write(pb.GenerateRequest(start=self._start(spec)))
            # NOTE: half-closed: the engine ends the stream once its one request is done, an error answered in
            # band (no usage follows it) included; left open, the stream would wait for more requests until the
            # timeout
            await call.done_writing()
            async for resp in call:
                now = time.perf_counter()
                if resp.HasField("error") and (resp.error.code or resp.error.message):
                    rec.fail(f"grpc_{grpc_code_name(resp.error.code)}", resp.error.message)
                if resp.token_ids:
                    rec.chunk(now, resp.text, resp.token_ids)
                if resp.finish_reason:
                    rec.finish_reason = _GRPC_FINISH.get(resp.finish_reason, str(resp.finish_reason))
                if resp.HasField("usage"):
                    rec.prompt_tokens = resp.usage.prompt_tokens
                    rec.output_tokens = resp.usage.completion_tokens
                    completed = True
                    break
        except grpc.aio.AioRpcError as err:
            rec.fail(f"grpc_{err.code().name}", err.details() or "")
        finally:
            call.cancel()
        rec.finish(time.perf_counter(), completed)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class OpenAIBackend:
    """The proxy's streaming `/v1/completions` (token ids or text) or `/v1/chat/completions` (messages)."""

    name = "openai"

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 timeout: float | None = None, temperature: float = 0.0):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model, self.temperature = model, temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # NOTE: no connection limit: the runner decides concurrency, the pool must not queue.
        self.client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=httpx.Timeout(timeout),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def open(self) -> str:
        if self.model is None:
            r = await self.client.get("/v1/models", timeout=30)
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    def _body(self, spec: RequestSpec) -> tuple[str, dict]:
        body = {"model": self.model, "max_tokens": spec.max_tokens, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}, **spec.extra}
        if spec.ignore_eos:
            body["ignore_eos"] = True
        if spec.messages is not None:
            return "/v1/chat/completions", {**body, "messages": spec.messages}
        prompt = spec.prompt_token_ids if spec.prompt_token_ids is not None else spec.prompt
        return "/v1/completions", {**body, "prompt": prompt}

    async def send(self, spec: RequestSpec, rec: RequestRecord) -> None:
        path, body = self._body(spec)
        completed = False
        rec.start = time.perf_counter()
        try:
            async with self.client.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    rec.fail(f"http_{r.status_code}", _error_message(r.text))
                else:
                    completed = await self._read_events(r, rec)
        except httpx.TimeoutException as err:
            rec.fail("timeout", repr(err))
        except httpx.ConnectError as err:
            rec.fail("connect", repr(err))
        except (httpx.RemoteProtocolError, httpx.ReadError) as err:
            rec.fail("truncated", repr(err))
        rec.finish(time.perf_counter(), completed)

    async def _read_events(self, r: httpx.Response, rec: RequestRecord) -> bool:
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return True
            now = time.perf_counter()
            obj = json.loads(data)
            if "error" in obj:
                rec.fail("stream_error", _error_message(data))
                continue
            for choice in obj.get("choices") or ():
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if text:  # a chunk counts as output when it carries text, as in `vllm bench serve`
                    rec.chunk(now, text)
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
            if obj.get("usage"):
                rec.prompt_tokens = obj["usage"].get("prompt_tokens", 0)
                rec.output_tokens = obj["usage"].get("completion_tokens", 0)
        return False

    async def close(self) -> None:
        await self.client.aclose()


def grpc_code_name(code: int) -> str:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return str(code)


def _error_message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:300]
