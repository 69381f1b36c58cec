"""The engine's asyncio face: the step loop runs in its own thread so the event loop stays free."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.request import CompletionDelta, EngineRequest, Usage
from inference_service.engine.sequence import FinishReason
from inference_service.errors import EngineError, InvalidRequestError, ResourceExhaustedError, ShuttingDownError

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Runs `LLMEngine.step()` in a background thread and streams each request's deltas.

    Commands (add, abort) travel to the thread through a queue and are applied between steps, so
    a cancelled request is freed within one step. Deltas come back to the event loop in one
    batch per step.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue[CompletionDelta]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.is_draining = False
        self._num_pending_adds = 0  # sent to the thread, not yet in the scheduler
        self._num_waiting = 0  # scheduler's waiting queue after the last step

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Aborts whatever is left and stops the step thread."""
        self._stopped = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    async def generate(self, request: EngineRequest) -> AsyncIterator[CompletionDelta]:
        """Submits a request and yields its deltas until its last one (the one with usage).

        Leaving the iteration early (the client went away) aborts the request.
        """
        if self.is_draining or self._stopped:
            raise ShuttingDownError("the engine is shutting down and accepts no new requests")
        if request.params.structured_output is not None and request.grammar is None:
            # A large schema can take a while to compile: not on the step thread, where it would stall
            # every running request. A bad format raises here, like the other request checks (first: no await
            # may come between the checks below and the registration of the stream).
            request.grammar = await asyncio.to_thread(self.engine.grammar_compiler.compile,
                                                      request.params.structured_output)
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", field="request_id")
        limit = self.engine.config.scheduler.max_waiting_requests
        if self._num_waiting + self._num_pending_adds >= limit:
            raise ResourceExhaustedError(f"the engine's waiting queue is full ({limit} requests); retry later")
        stream: asyncio.Queue[CompletionDelta] = asyncio.Queue()
        self._streams[request.request_id] = stream
        self._num_pending_adds += 1
        self._send(("add", request))
        finished = False
        try:
            while True:
                delta = await stream.get()
                if delta.is_last:
                    finished = True
                yield delta
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self._send(("abort", request.request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def run_on_engine_thread(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs `fn()` on the step thread between two steps; returns its future.

        NOTE: for model work outside the scheduler (decoder embeddings): the attention backend keeps
        per-step state, so the model must never run on two threads at once."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(("call", (fn, future)))
        return future

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- the engine thread --------------------------------------------------------------------

    def _apply_commands(self) -> list[CompletionDelta]:
        deltas: list[CompletionDelta] = []
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return deltas
            if kind == "add":
                self._loop.call_soon_threadsafe(self._added_to_engine)
                try:
                    self.engine.add_request(arg)
                except EngineError as e:  # validation that needs engine state (cache size)
                    self.engine.metrics.on_request_rejected()
                    usage = Usage(len(arg.prompt_token_ids), 0, 0)
                    deltas.append(CompletionDelta(arg.request_id, 0, [], "", finish_reason=FinishReason.ERROR, usage=usage, error=e))
            elif kind == "call":
                fn, future = arg
                deltas.extend(self.engine.drain())  # the model runs one step at a time
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        future.set_exception(e)
            else:
                deltas.extend(self.engine.abort_request(arg))

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped:
            deltas = self._apply_commands()
            if engine.has_unfinished:
                try:
                    deltas.extend(engine.step())
                except Exception:
                    logger.exception("engine step failed; failing the running requests")
                    for request_id in list(engine.requests):
                        deltas.extend(engine.abort_request(request_id, FinishReason.ERROR))
            self._num_waiting = len(engine.scheduler.waiting)
            if deltas:
                self._loop.call_soon_threadsafe(self._dispatch, deltas)
            if not engine.has_unfinished and not deltas:
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
        for request_id in list(engine.requests):
            deltas = engine.abort_request(request_id)
            self._loop.call_soon_threadsafe(self._dispatch, deltas)

    def _added_to_engine(self) -> None:
        self._num_pending_adds -= 1

    def _dispatch(self, deltas: list[CompletionDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)

