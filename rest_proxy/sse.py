"""Server-sent events: errors before the first event are plain HTTP errors, later ones an `error` event;
a client that goes away cancels the producer (and with it the engine call) at once."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from rest_proxy.errors import ProxyError
from rest_proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)


class EventStreamResponse(StreamingResponse):
    """Streams while watching for the client's disconnect, whatever the ASGI server's spec version."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    tg.cancel_scope.cancel()
                    break


async def event_stream(events: AsyncIterator[str], metrics: ProxyMetrics) -> EventStreamResponse:
    """Wait for the first event (so early errors keep their HTTP status), then stream the rest."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = "data: [DONE]\n\n"
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

    return EventStreamResponse(body(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
