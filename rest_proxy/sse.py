"""Server-sent events: errors before the first event are plain HTTP errors, later ones an `error` event.

A client that goes away cancels the producer (and the engine call) through `CancelOnDisconnectMiddleware`."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from rest_proxy.errors import ProxyError
from rest_proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)


async def event_stream(events: AsyncIterator[str], metrics: ProxyMetrics) -> StreamingResponse:
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

    return StreamingResponse(body(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
