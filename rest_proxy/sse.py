"""Server-sent events: errors before the first event are plain HTTP errors, later ones an `error` event.

Chat and completions streams are `data:` chunks written by one `ChunkWriter` and closed by `[DONE]`.
A client that goes away cancels the producer (and the engine call) through `CancelOnDisconnectMiddleware`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass

from starlette.responses import StreamingResponse

from rest_proxy.errors import ProxyError
from rest_proxy.events import StreamUsage
from rest_proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class ChunkWriter:
    """The `data:` chunks of one chat or completions stream. Each carries the stream's id, object, created,
    model and system_fingerprint; with include_usage each also carries `usage`, null on all but the
    usage-only chunk that comes last, as OpenAI's streams do."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str
    include_usage: bool

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "system_fingerprint": self.system_fingerprint, "choices": choices}
        if self.include_usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def write_chunks(writer: ChunkWriter, events: AsyncIterator,
                       choices: Callable[[object], Iterable[list[dict]]]) -> AsyncIterator[str]:
    """The chunks of an event stream: one per item of `choices(event)` (a chunk's choices), the usage-only
    chunk where include_usage asks for it, then `[DONE]`. Closes `events` however the stream ends."""
    async with aclosing(events) as closing:
        async for event in closing:
            if isinstance(event, StreamUsage):
                if writer.include_usage:
                    yield writer.chunk([], event.usage)
                continue
            for chunk_choices in choices(event):
                yield writer.chunk(chunk_choices)
    yield DONE


def typed_event(event: dict) -> str:
    """An `event: TYPE` event and its JSON: the Responses API's framing (it has no `[DONE]`)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def event_stream(events: AsyncIterator[str], metrics: ProxyMetrics) -> StreamingResponse:
    """Wait for the first event (so early errors keep their HTTP status), then stream the rest."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = DONE
    except BaseException:
        await events.aclose()
        raise

    async def body() -> AsyncIterator[str]:
        metrics.open_streams.inc()
        try:
            yield first
            async for event in events:
                yield event
        except ProxyError as err:
            yield f"data: {json.dumps(err.body())}\n\n"
        except Exception as err:  # noqa: BLE001 - the stream is already open; report in-band
            log.exception("stream failed")
            yield f"data: {json.dumps(ProxyError(500, f'internal error: {err}').body())}\n\n"
        finally:
            metrics.open_streams.dec()
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
