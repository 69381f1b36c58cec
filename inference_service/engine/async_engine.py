"""The engine's asyncio face: the step loop runs in its own thread so the event loop stays free."""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import AsyncIterator

from inference_service.engine.background_loop import BackgroundLoop
from inference_service.engine.commands import (ENGINE_COMMAND_TYPES, AbortRequest, AddRequest, EmbedBatch,
                                               EngineCommand)
from inference_service.engine.embedding_model import EmbeddingModel
from inference_service.engine.info import EngineInfo
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.request import CompletionDelta, EngineRequest
from inference_service.engine.sequence import FinishReason
from inference_service.errors import EngineError, InvalidRequestError, ResourceExhaustedError

logger = logging.getLogger(__name__)


class AsyncEngine(BackgroundLoop):
    """Runs `LLMEngine.step()` in a background thread and streams each request's deltas.

    Commands (`AddRequest`, `AbortRequest`, `EmbedBatch`) travel to the thread through a queue and are
    applied between steps, so a cancelled request is freed within one step. Deltas come back to the
    event loop in one batch per step. The front end (the servicer) reads the engine through this
    class only: `generate`, `abort`, `info`, `count_rejected`.
    """

    def __init__(self, llm_engine: LLMEngine):
        super().__init__("engine-loop")
        self.llm_engine = llm_engine
        self._info = llm_engine.info()
        self._embedding_model: EmbeddingModel | None = None  # runs `EmbedBatch` jobs, when serving embeddings
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[CompletionDelta]] = {}
        self._num_pending_adds = 0  # sent to the thread, not yet in the scheduler
        self._num_waiting = 0  # scheduler's waiting queue after the last step

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def info(self) -> EngineInfo:
        """The engine's sizes and limits."""
        return self._info

    def count_rejected(self) -> None:
        """Counts a generation request refused before it ran (bad input, full queue, shutdown)."""
        self.llm_engine.metrics.on_request_rejected()

    def serve_embeddings(self, model: EmbeddingModel) -> None:
        """Lets `EmbedBatch` jobs run `model` on the engine thread (call before `start`)."""
        self._embedding_model = model

    async def generate(self, request: EngineRequest) -> AsyncIterator[CompletionDelta]:
        """Submits a request and yields its deltas until its last one (the one with usage).

        Leaving the iteration early (the client went away) aborts the request.
        """
        self.check_accepting()
        if request.params.structured_output is not None and request.grammar is None:
            # A large schema can take a while to compile: not on the step thread, where it would stall
            # every running request. A bad format raises here, like the other request checks (first: no await
            # may come between the checks below and the registration of the stream).
            request.grammar = await asyncio.to_thread(self.llm_engine.compile_grammar,
                                                      request.params.structured_output)
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", field="request_id")
        limit = self._info.max_waiting_requests
        if self._num_waiting + self._num_pending_adds >= limit:
            raise ResourceExhaustedError(f"the engine's waiting queue is full ({limit} requests); retry later")
        stream: asyncio.Queue[CompletionDelta] = asyncio.Queue()
        self._streams[request.request_id] = stream
        self._num_pending_adds += 1
        self.send(AddRequest(request))
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
                self.send(AbortRequest(request.request_id))

    def abort(self, request_id: str) -> None:
        self.send(AbortRequest(request_id))

    def send(self, command: EngineCommand) -> None:
        """Queues a command for the engine thread; anything but an `EngineCommand` is a `TypeError`."""
        if not isinstance(command, ENGINE_COMMAND_TYPES):
            raise TypeError(f"not an engine command: {command!r}")
        self._commands.put(command)
        self._wake()

    # ---- the engine thread --------------------------------------------------------------------

    def _apply_commands(self) -> list[CompletionDelta]:
        deltas: list[CompletionDelta] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return deltas
            deltas += self._apply(command)

    def _apply(self, command: EngineCommand) -> list[CompletionDelta]:
        match command:
            case AddRequest(request=request):
                return self._add(request)
            case AbortRequest(request_id=request_id):
                return self.llm_engine.abort_request(request_id)
            case EmbedBatch():
                return self._embed(command)
            case _:
                raise TypeError(f"not an engine command: {command!r}")

    def _add(self, request: EngineRequest) -> list[CompletionDelta]:
        self._call_in_event_loop(self._added_to_engine)
        return self.llm_engine.add_or_reject(request)

    def _embed(self, job: EmbedBatch) -> list[CompletionDelta]:
        deltas = self.llm_engine.wait_for_in_flight_step()  # the model runs one batch at a time
        if job.result.set_running_or_notify_cancel():
            try:
                if self._embedding_model is None:
                    raise EngineError("this engine serves no embeddings")
                job.result.set_result(self._embedding_model.embed_token_ids(job.token_ids))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                job.result.set_exception(e)
        return deltas

    def _run_once(self) -> bool:
        llm_engine = self.llm_engine
        deltas = self._apply_commands()
        if llm_engine.has_unfinished:
            try:
                deltas += llm_engine.step()
            except Exception:
                logger.exception("engine step failed; failing the running requests")
                deltas += llm_engine.abort_all(FinishReason.ERROR)
        self._num_waiting = llm_engine.num_waiting
        if deltas:
            self._call_in_event_loop(self._dispatch, deltas)
        return bool(deltas) or llm_engine.has_unfinished

    def _on_stopped(self) -> None:
        self._call_in_event_loop(self._dispatch, self.llm_engine.abort_all())

    def _added_to_engine(self) -> None:
        self._num_pending_adds -= 1

    def _dispatch(self, deltas: list[CompletionDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)
