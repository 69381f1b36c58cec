"""A scripted engine: the real proto served in-process on loopback, answering with fixed text.

Output is chosen from the prompt: `engine.script[last user message] = text` (or a list, one per
completion), else a default sentence. Commands in the last user message script failures:
`!error CODE FIELD` (in-band error), `!status CODE` (the call ends with that status), `!hang` (never
answers), `!slow` (a long answer, slowly). Every request and cancellation is recorded.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from inference_service.api import pb, pb_grpc

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
DEFAULT_TEXT = "Hello from the fake engine."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokens_of(text: str) -> list[str]:
    """Fake tokenization: pieces of up to 3 characters."""
    return [text[i:i + 3] for i in range(0, len(text), 3)]


def render_chat(chat: pb.ChatInput) -> str:
    out = ""
    for m in chat.messages:
        body = m.content
        for c in m.tool_calls:
            body += json.dumps({"name": c.name, "arguments": json.loads(c.arguments_json or "{}")})
        out += f"<|im_start|>{m.role}\n{body}"
        if not (chat.continue_final_message and m is chat.messages[-1]):
            out += "<|im_end|>\n"
    if chat.add_generation_prompt and not chat.continue_final_message:
        out += "<|im_start|>assistant\n"
    return out


@dataclass
class FakeEngine(pb_grpc.InferenceServiceServicer):
    model_name: str = "fake-model"
    family: str = "llama"
    chat_template: str = CHATML
    max_context_length: int = 2048
    supports_embed: bool = False
    token_delay: float = 0.0
    script: dict[str, str | list[str]] = field(default_factory=dict)
    requests: list[pb.StartGeneration] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    aborted_calls: int = 0

    def reset(self) -> None:
        self.script.clear()
        self.requests.clear()
        self.prompts.clear()
        self.cancelled.clear()
        self.aborted_calls = 0
        self.token_delay = 0.0

    # -- the scripted answer --------------------------------------------------------------------
    def _prompt_key(self, start: pb.StartGeneration) -> str:
        which = start.WhichOneof("input")
        if which == "chat":
            users = [m.content for m in start.chat.messages if m.role in ("user", "tool")]
            return users[-1] if users else ""
        if which == "text":
            return start.text
        return " ".join(str(i) for i in start.token_ids.ids)

    def _prompt_text(self, start: pb.StartGeneration) -> str:
        which = start.WhichOneof("input")
        if which == "chat":
            return render_chat(start.chat)
        return start.text if which == "text" else "".join(chr(i % 0xD800) for i in start.token_ids.ids)

    def _outputs(self, start: pb.StartGeneration, key: str) -> list[str]:
        n = max(start.n, 1)
        text = self.script.get(key, DEFAULT_TEXT)
        if key == "!slow":
            text = "word " * 400
        if start.chat.continue_final_message and start.chat.messages and key not in self.script:
            text = self.script.get("!prefilled", text)
        if isinstance(text, list):
            return [text[i % len(text)] for i in range(n)]
        if start.sampling.HasField("seed"):
            text = f"{text} seed={start.sampling.seed}"
        return [text] * n

    def _logprobs(self, piece: str, k: int, top: int) -> pb.TokenLogprob:
        lp = pb.TokenLogprob(token_id=ord(piece[0]), token=piece, token_bytes=piece.encode(), logprob=-0.5 - k % 3)
        for j in range(top):
            alt = piece if j == 0 else f"{piece}{j}"
            lp.top_logprobs.append(pb.TopLogprob(token_id=ord(alt[0]) + j, token=alt, token_bytes=alt.encode(),
                                                 logprob=-0.5 - k % 3 - j))
        return lp

    async def _run(self, start: pb.StartGeneration, out: asyncio.Queue, context) -> None:
        rid = start.request_id
        key = self._prompt_key(start)
        self.requests.append(start)
        self.prompts.append(self._prompt_text(start))
        words = key.split()
        if words[:1] == ["!error"]:
            code, field_name = int(words[1]), (words[2] if len(words) > 2 else "")
            await out.put(pb.GenerateResponse(request_id=rid, finish_reason=pb.FINISH_REASON_ERROR, error=pb.Error(
                code=code, message=f"scripted error {code} for {field_name}: the prompt has 9000 tokens but "
                                   f"the context holds 2048", field=field_name)))
            return
        if words[:1] == ["!status"]:
            await out.put(grpc.StatusCode[words[1]] if not words[1].isdigit() else int(words[1]))
            return
        if words[:1] == ["!hang"]:
            await asyncio.sleep(3600)
        prompt_tokens = len(tokens_of(self._prompt_text(start)))
        prompt_logprobs = []
        if start.sampling.HasField("prompt_logprobs"):  # per character, as `Tokenize` splits text
            text = self._prompt_text(start)
            prompt_logprobs = [self._logprobs(c, k, start.sampling.prompt_logprobs) for k, c in enumerate(text[1:])]
        total = 0
        stops = list(start.stopping.stop)
        max_tokens = start.stopping.max_tokens if start.stopping.HasField("max_tokens") else None
        delay = 0.02 if key == "!slow" else self.token_delay
        outputs = self._outputs(start, key)
        for index, text in enumerate(outputs):
            reason, stop_reason = pb.FINISH_REASON_STOP, ""
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:
                stop_reason = next(s for s in stops if text.find(s) == cut)
                text = text[:cut]
            pieces = tokens_of(text)
            if max_tokens is not None and len(pieces) > max_tokens:
                pieces, reason, stop_reason = pieces[:max_tokens], pb.FINISH_REASON_LENGTH, ""
            for k, piece in enumerate(pieces):
                if delay:
                    await asyncio.sleep(delay)
                resp = pb.GenerateResponse(request_id=rid, index=index, text=piece, token_ids=[ord(piece[0])])
                if index == 0 and k == 0:
                    resp.prompt_logprobs.extend(prompt_logprobs)
                if start.sampling.logprobs:
                    resp.logprobs.append(self._logprobs(piece, k, start.sampling.top_logprobs))
                if k == len(pieces) - 1:
                    resp.finish_reason, resp.stop_reason = reason, stop_reason
                total += 1
                await out.put(resp)
            if not pieces:
                await out.put(pb.GenerateResponse(request_id=rid, index=index, finish_reason=reason))
        last = pb.GenerateResponse(request_id=rid, index=len(outputs) - 1)
        last.usage.CopyFrom(pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=total, cached_tokens=3))
        await out.put(last)

    # -- the gRPC methods -----------------------------------------------------------------------
    async def Generate(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}

        async def read() -> None:
            async for msg in request_iterator:
                if msg.WhichOneof("action") == "start":
                    tasks[msg.start.request_id] = asyncio.create_task(self._run(msg.start, out, context))
                else:
                    self.cancelled.append(msg.cancel.request_id)
                    task = tasks.pop(msg.cancel.request_id, None)
                    if task is not None:
                        task.cancel()
                        await out.put(pb.GenerateResponse(request_id=msg.cancel.request_id,
                                                          finish_reason=pb.FINISH_REASON_ABORT))

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await out.get()
                if isinstance(item, (int, grpc.StatusCode)):
                    code = item if isinstance(item, grpc.StatusCode) else next(
                        c for c in grpc.StatusCode if c.value[0] == item)
                    await context.abort(code, f"scripted status {code.name}")
                yield item
        except asyncio.CancelledError:
            self.aborted_calls += 1
            raise
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()

    async def Tokenize(self, request_iterator, context):
        async for req in request_iterator:
            op = req.WhichOneof("operation")
            resp = pb.TokenizeResponse(request_id=req.request_id)
            if op == "tokenize":
                text = req.tokenize.text
            elif op == "render_chat":
                text = render_chat(req.render_chat)
                resp.text = text
            else:
                if any(i > 0x10FFFF for i in req.detokenize.ids):
                    resp.error.CopyFrom(pb.Error(code=3, message="token id out of range", field="detokenize.ids"))
                else:
                    resp.text = "".join(chr(i) for i in req.detokenize.ids if not 0xD800 <= i <= 0xDFFF)
                yield resp
                continue
            resp.token_ids.extend(ord(c) for c in text)
            resp.tokens.extend(text)
            yield resp

    async def Embed(self, request_iterator, context):
        async for req in request_iterator:
            resp = pb.EmbedResponse(request_id=req.request_id)
            if not self.supports_embed:
                resp.error.CopyFrom(pb.Error(code=grpc.StatusCode.UNIMPLEMENTED.value[0],
                                             message=f"{self.model_name} is generative and serves no embeddings"))
            else:
                for item in req.inputs:
                    n = len(item.text) if item.WhichOneof("input") == "text" else len(item.token_ids.ids)
                    dims = req.dimensions or 4
                    resp.embeddings.append(pb.Embedding(values=[float(n + d) for d in range(dims)], num_tokens=n))
                    resp.prompt_tokens += n
            yield resp

    async def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(
            model_name=self.model_name, family=self.family, architecture="LlamaForCausalLM",
            max_context_length=self.max_context_length, vocab_size=49152, has_chat_template=True,
            chat_template=self.chat_template, supports_generate=True, supports_embed=self.supports_embed,
            model_path=f"/fake/{self.model_name}",
            special_tokens=pb.SpecialTokens(eos_token_ids=[2], eos_token="<|im_end|>"),
            kv_cache=pb.KvCacheInfo(block_size=16, num_blocks=64, dtype="float32", device="cpu"))


class FakeEngineServer:
    """Serves a `FakeEngine` (plus grpc.health.v1) on a loopback port from its own thread."""

    def __init__(self, engine: FakeEngine | None = None, port: int | None = None, *,
                 interceptors: list | None = None, credentials: grpc.ServerCredentials | None = None):
        """`interceptors` and `credentials` (TLS) are the real engine's, to test what the proxy presents."""
        self.engine = engine or FakeEngine()
        self.port = port or free_port()
        self._interceptors, self._credentials = interceptors, credentials
        self.loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self) -> None:
        self._server = grpc.aio.server(interceptors=self._interceptors)
        pb_grpc.add_InferenceServiceServicer_to_server(self.engine, self._server)
        health_servicer = health.aio.HealthServicer()
        for service in ("", "inference.v1.InferenceService"):  # the name Envoy's health checks ask for
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        if self._credentials is not None:
            self._server.add_secure_port(self.target, self._credentials)
        else:
            self._server.add_insecure_port(self.target)
        await self._server.start()

    def start(self) -> FakeEngineServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
