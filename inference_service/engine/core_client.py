"""The front end's face of the engine core process: `AsyncEngine`'s interface over two pipes.

`CoreClient.spawn` starts the core (core_process.py) and waits until it loaded its model. Afterwards the
event loop reads the core's step outputs as they come (one per step, every sequence's tokens in it) and
routes each delta to its request's stream. Commands are written from the event loop too, with no thread
hop on a first token's path (a sender thread waited for the GIL behind the busy loop): the commands one loop
iteration queued go out as one message, and a busy core (a full pipe) never blocks the loop, the rest waiting
until the pipe is writable. If the core dies, every request in flight ends with UNAVAILABLE
(`EngineCoreDiedError`) and `on_core_died` tells the server, which goes down with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import struct
from collections.abc import AsyncIterator, Callable
from multiprocessing.reduction import ForkingPickler

import torch

from inference_service.config import EngineConfig
from inference_service.engine.commands import AbortRequest, AddRequest, EmbedBatch
from inference_service.engine.core_messages import (
    CoreReady,
    CoreStartFailed,
    EmbedJob,
    EmbedResult,
    Shutdown,
    StepOutput,
)
from inference_service.engine.core_process import run_engine_core
from inference_service.engine.info import EngineInfo, EngineLoad
from inference_service.engine.request import CompletionDelta, EngineRequest
from inference_service.errors import (
    EngineCoreDiedError,
    InvalidRequestError,
    ResourceExhaustedError,
    ShuttingDownError,
)
from inference_service.metrics import EngineMetrics

logger = logging.getLogger(__name__)


def connection_frame(obj) -> bytes:
    """`obj` as `multiprocessing.connection.Connection.send` writes it (a big-endian 32-bit length, then the
    pickle), so that the core's `Connection.recv` reads what the loop writes without blocking."""
    data = ForkingPickler.dumps(obj)
    if len(data) > 0x7FFFFFFF:
        raise ValueError(f"a command message of {len(data)} bytes is over the pipe's 2 GiB frame")
    return struct.pack("!i", len(data)) + data


class CoreClient:
    """Generation (and embedding batches) in the engine core process; `start()` in the event loop, `await stop()`.

    The servicer uses it as it would an `AsyncEngine`: `generate`, `abort`, `info`, `count_rejected`."""

    def __init__(self, process: multiprocessing.process.BaseProcess, commands, outputs, ready: CoreReady,
                 metrics: EngineMetrics | None = None):
        self.process = process
        self.ready = ready
        self.metrics = metrics or EngineMetrics(ready.model.name)
        self.is_draining = False
        self.on_core_died: Callable[[], None] | None = None  # set by the server
        self.load: EngineLoad | None = None  # the core's queues and cache after its latest output
        self._commands, self._outputs = commands, outputs
        self._queued_commands: list = []  # this loop iteration's, written as one message
        self._unwritten = bytearray()  # of the messages, what the pipe did not take yet
        self._is_waiting_writable = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[CompletionDelta | BaseException]] = {}
        self._embed_jobs: dict[int, concurrent.futures.Future] = {}
        self._job_ids = itertools.count()
        self._num_pending_adds = 0
        self._is_stopping = False
        self.is_dead = False

    @classmethod
    def spawn(cls, config: EngineConfig, log_level: str = "info") -> CoreClient:
        """Starts the core process and waits until it loaded its model; its start failure is raised here."""
        ctx = multiprocessing.get_context("spawn")
        commands_recv, commands_send = ctx.Pipe(duplex=False)
        outputs_recv, outputs_send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=run_engine_core, name="engine-core", daemon=True,
                              args=(config, commands_recv, outputs_send, log_level))
        process.start()
        # Only the core holds these ends now: its death is EOF on ours.
        commands_recv.close()
        outputs_send.close()
        try:
            message = outputs_recv.recv()
        except EOFError:
            process.join(5)
            raise RuntimeError(f"the engine core exited with code {process.exitcode} while starting") from None
        if isinstance(message, CoreStartFailed):
            process.join(10)
            raise message.error
        return cls(process, commands_send, outputs_recv, message)

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def info(self) -> EngineInfo:
        """The engine's sizes and limits."""
        return self.ready.info

    def count_rejected(self) -> None:
        """Counts a generation request refused before it reached the core."""
        self.metrics.on_request_rejected()

    def serve_embeddings(self, model) -> None:
        """The core runs its own embedding model; nothing to hand over."""

    def check_accepting(self) -> None:
        if self.is_dead:
            raise EngineCoreDiedError("the engine core process is gone; the server is going down")
        if self.is_draining or self._is_stopping:
            raise ShuttingDownError("the engine is shutting down and accepts no new requests")

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._outputs.fileno(), self._read_outputs)
        os.set_blocking(self._commands.fileno(), False)

    async def stop(self) -> None:
        """Tells the core to abort what is left and exit; waits for it (kills it after 30 s)."""
        self._is_stopping = True
        if not self.is_dead:
            self._post(Shutdown())
            await asyncio.to_thread(self.process.join, 30)
            if self.process.exitcode is None:
                logger.error("the engine core did not exit; killing it")
                self.process.kill()
                await asyncio.to_thread(self.process.join, 5)
            self._read_outputs()  # the last deltas, then EOF
        self._stop_writing()

    async def generate(self, request: EngineRequest) -> AsyncIterator[CompletionDelta]:
        """Submits a request and yields its deltas until its last one; leaving early aborts it."""
        self.check_accepting()
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", field="request_id")
        limit = self.ready.info.max_waiting_requests
        num_waiting = self.load.num_waiting if self.load is not None else 0
        if num_waiting + self._num_pending_adds >= limit:
            raise ResourceExhaustedError(f"the engine's waiting queue is full ({limit} requests); retry later")
        # NOTE: a format is compiled in the core (an llguidance matcher does not cross processes); a bad
        # one comes back as the request's error delta.
        request.grammar = None
        stream: asyncio.Queue[CompletionDelta | BaseException] = asyncio.Queue()
        self._streams[request.request_id] = stream
        self._num_pending_adds += 1
        self._post(AddRequest(request))
        finished = False
        try:
            while True:
                delta = await stream.get()
                if isinstance(delta, BaseException):
                    finished = True
                    raise delta
                finished = delta.is_last
                yield delta
                if finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        if not self.is_dead:
            self._post(AbortRequest(request_id))

    def send(self, command: EmbedBatch) -> None:
        """Runs an embedding batch in the core (from any thread); its result arrives on `command.result`."""
        if not isinstance(command, EmbedBatch):
            raise TypeError(f"not an embedding batch: {command!r}")
        if self.is_dead:
            command.result.set_exception(EngineCoreDiedError("the engine core process is gone"))
            return
        job_id = next(self._job_ids)
        self._embed_jobs[job_id] = command.result
        self._loop.call_soon_threadsafe(self._post, EmbedJob(job_id, command.token_ids))

    # ---- the pipes ----------------------------------------------------------------------------

    def _post(self, command) -> None:
        """On the event loop: `command` goes out with the others queued in this loop iteration."""
        if self._commands.closed:
            return
        self._queued_commands.append(command)
        if len(self._queued_commands) == 1:
            self._loop.call_soon(self._write_commands)

    def _write_commands(self) -> None:
        """Writes what the pipe takes now; the rest when it is writable again."""
        if self._commands.closed:
            return
        if self._queued_commands:
            self._unwritten += connection_frame(self._queued_commands)
            self._queued_commands = []
        try:
            del self._unwritten[:os.write(self._commands.fileno(), self._unwritten)]
        except BlockingIOError:
            pass
        except OSError:  # the core is gone; the outputs' reader reports it
            self._stop_writing()
            return
        if self._unwritten and not self._is_waiting_writable:
            self._loop.add_writer(self._commands.fileno(), self._write_commands)
        elif not self._unwritten and self._is_waiting_writable:
            self._loop.remove_writer(self._commands.fileno())
        self._is_waiting_writable = bool(self._unwritten)

    def _stop_writing(self) -> None:
        if self._is_waiting_writable:
            self._loop.remove_writer(self._commands.fileno())
            self._is_waiting_writable = False
        self._queued_commands, self._unwritten = [], bytearray()
        self._commands.close()

    def _read_outputs(self) -> None:
        """On the event loop, whenever the outputs pipe is readable."""
        if self._outputs.closed:
            return
        try:
            while self._outputs.poll():
                self._handle(self._outputs.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(self._outputs.fileno())
            self._outputs.close()
            if not self._is_stopping:
                self._core_died()

    def _handle(self, output: StepOutput) -> None:
        self.load = output.load
        self._num_pending_adds -= output.num_added
        for delta in output.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is not None:
                stream.put_nowait(delta)
        if output.metric_events:
            # After the streams had their turn: a finished request's log line is not on its first token's path.
            self._loop.call_soon(self.metrics.apply, output.metric_events)
        for result in output.embeddings:
            self._finish_embedding(result)

    def _finish_embedding(self, result: EmbedResult) -> None:
        future = self._embed_jobs.pop(result.job_id, None)
        if future is None or not future.set_running_or_notify_cancel():
            return
        if result.error is not None:
            future.set_exception(result.error)
        else:
            future.set_result(torch.from_numpy(result.embeddings))

    def _core_died(self) -> None:
        self.is_dead = True
        self.process.join(1)
        logger.error("the engine core process died (exit code %s); failing %d requests in flight",
                     self.process.exitcode, len(self._streams))
        error = EngineCoreDiedError(f"the engine core process died (exit code {self.process.exitcode})")
        for stream in self._streams.values():
            stream.put_nowait(error)
        for future in self._embed_jobs.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._embed_jobs.clear()
        self._stop_writing()
        if self.on_core_died is not None:
            self.on_core_died()
