"""A worker thread beside the event loop, the shape both engines share."""

from __future__ import annotations

import asyncio
import threading

from inference_service.errors import ShuttingDownError


class BackgroundLoop:
    """Runs `_run_once()` on its own thread until stopped; `start()` inside the event loop, `await stop()`.

    `_run_once()` returns whether it did work; when it did none, the thread sleeps until `_wake()` (or a
    second, so a stop is noticed). `is_draining` (set by the server's graceful shutdown) refuses new
    requests while the ones in flight finish; `stop()` ends the thread, then `_on_stopped()` runs on it.
    """

    def __init__(self, thread_name: str):
        self._thread_name = thread_name
        self._wakeup = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.is_draining = False

    @property
    def num_active_requests(self) -> int:
        """Requests accepted and not yet answered (the server's shutdown waits for 0)."""
        raise NotImplementedError

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stops the thread; what it still held is ended by `_on_stopped`."""
        self._stopped = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    def check_accepting(self) -> None:
        """Raises `ShuttingDownError` once a shutdown began."""
        if self.is_draining or self._stopped:
            raise ShuttingDownError("the engine is shutting down and accepts no new requests")

    def _wake(self) -> None:
        self._wakeup.set()

    def _call_in_event_loop(self, fn, *args) -> None:
        """From the thread: runs `fn(*args)` on the event loop."""
        self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        while not self._stopped:
            if not self._run_once():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
        self._on_stopped()

    def _run_once(self) -> bool:
        raise NotImplementedError

    def _on_stopped(self) -> None:
        """On the thread, after its last `_run_once`."""
