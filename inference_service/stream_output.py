"""The responses of one bidi stream on their way to its client, bounded by how long the client lets them wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

_WAKE = object()  # wakes the response loop when a request or the reader ends


class ResponseQueue:
    """Responses of a stream's requests, yielded to gRPC in the order they were put.

    gRPC's flow control holds a write while the client does not read, and with it this queue; the
    engine meanwhile keeps generating. `stall_reason()` says when the client has not taken a
    response for `max_stall_s` seconds, or lets more than `max_queued` pile up, so that the caller
    can abort its requests (freeing their KV blocks) rather than generate for nobody.
    """

    def __init__(self, max_stall_s: float = float("inf"), max_queued: int | None = None):
        self.max_stall_s = max_stall_s
        self.max_queued = max_queued
        self._queue: asyncio.Queue = asyncio.Queue()
        self._write_started: float | None = None  # when gRPC took the response it is still writing

    def put(self, response: Any) -> None:
        self._queue.put_nowait(response)

    def wake(self) -> None:
        self._queue.put_nowait(_WAKE)

    def stall_reason(self) -> str | None:
        """Why the client counts as not reading, or None while it reads."""
        if self.max_queued is not None and self._queue.qsize() > self.max_queued:
            return f"the client let more than {self.max_queued} responses wait unread"
        started = self._write_started
        if started is not None and time.monotonic() - started > self.max_stall_s:
            return f"the client has not read a response for {self.max_stall_s:g} s"
        return None

    async def responses(self, active: dict[str, asyncio.Task], reader: Coroutine) -> AsyncIterator:
        """Yields what the request tasks put until `reader` (the client's requests) ended and every
        task in `active` ended.

        Leaving early (client gone, deadline) cancels the reader and every request task, which aborts
        their engine requests."""
        reader_task = asyncio.create_task(reader)
        try:
            while not (reader_task.done() and not active and self._queue.empty()):
                item = await self._queue.get()
                if item is _WAKE:
                    continue
                self._write_started = time.monotonic()
                yield item  # NOTE: resumes once gRPC has written it, which waits for the client to read
                self._write_started = None
            await reader_task  # surfaces a failure of the request stream itself
        finally:
            reader_task.cancel()
            for task in list(active.values()):
                task.cancel()
