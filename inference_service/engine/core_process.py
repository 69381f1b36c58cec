"""The engine core process: scheduler, model runner and output processing in a busy loop of their own.

No gRPC and no asyncio share this process's GIL: the loop takes the front end's commands between
steps, steps, and sends one `StepOutput` per step (core_messages.py). `CoreClient` (core_client.py)
spawns it and is its front end.

    front end (gRPC, tokenize, stream)            engine core (this file)
      commands pipe:  [AddRequest, AbortRequest, EmbedJob, Shutdown] ...  ->  applied before each step
      outputs pipe:   <- StepOutput(deltas of every sequence, load, metric events)  one per step

NOTE: the transport is two `multiprocessing` pipes carrying pickle-5 frames. Measured with
bench/core_transport.py (384 sequences a step, docs/operations.md has the numbers) it moves thousands
of step messages a second, the same order as ZMQ ipc with pickle and within a third of ZMQ with
msgspec, while a GPU step takes tens of milliseconds: the transport is well under 1% of a step either
way, so the pipes win by needing no dependency, carrying any picklable type (errors, embeddings), and
reporting the other side's death as EOF at once (the core-crash path).
"""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection

from inference_service.config import EngineConfig
from inference_service.engine.commands import AbortRequest, AddRequest
from inference_service.engine.core_messages import (
    CoreReady,
    CoreStartFailed,
    EmbedJob,
    EmbedResult,
    Shutdown,
    StepOutput,
)
from inference_service.engine.embedding_engine import create_embedding_model
from inference_service.engine.gc_heap import freeze_startup_heap
from inference_service.engine.info import ModelInfo
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.model_loading import load_model_for, resolve_device
from inference_service.engine.request import CompletionDelta
from inference_service.engine.sequence import FinishReason
from inference_service.metrics import MetricsRecorder

logger = logging.getLogger(__name__)


class EngineCore:
    """One model's generation engine (none for an encoder) and embedding model, driven by commands."""

    def __init__(self, config: EngineConfig):
        on_device = load_model_for(config)
        loaded, device, dtype = on_device.loaded, on_device.device, on_device.dtype
        self.metrics = MetricsRecorder()
        self.llm_engine = None if loaded.is_encoder else LLMEngine(config, loaded=loaded, metrics=self.metrics)
        max_model_len = self.llm_engine.max_model_len if self.llm_engine is not None else config.max_model_len
        self.embedding_model, self.max_embed_input_tokens = create_embedding_model(
            loaded, device=device, dtype=dtype, pooling_mode=config.embedding_pooling, max_model_len=max_model_len,
            block_size=config.cache.block_size)
        self.model = ModelInfo.of(loaded, config.served_model_name, device, dtype)
        self.is_stopping = False
        self._num_added = 0
        self._embeddings: list[EmbedResult] = []

    def ready(self) -> CoreReady:
        llm = self.llm_engine
        tokenizer = llm.tokenizer if llm is not None else self.embedding_model.tokenizer
        return CoreReady(self.model, llm.info() if llm is not None else None, tokenizer,
                         self.embedding_model.spec(), self.max_embed_input_tokens)

    @property
    def has_work(self) -> bool:
        return self.llm_engine is not None and self.llm_engine.has_unfinished

    def apply(self, command) -> list[CompletionDelta]:
        match command:
            case AddRequest(request=request):
                self._num_added += 1
                return self.llm_engine.add_or_reject(request)
            case AbortRequest(request_id=request_id):
                return self.llm_engine.abort_request(request_id)
            case EmbedJob():
                return self._embed(command)
            case Shutdown():
                self.is_stopping = True
                return self.llm_engine.abort_all() if self.llm_engine is not None else []
            case _:
                raise TypeError(f"not an engine core command: {command!r}")

    def step(self) -> list[CompletionDelta]:
        try:
            return self.llm_engine.step()
        except Exception:
            logger.exception("engine step failed; failing the running requests")
            return self.llm_engine.abort_all(FinishReason.ERROR)

    def take_output(self, deltas: list[CompletionDelta]) -> StepOutput:
        llm = self.llm_engine
        output = StepOutput(deltas, llm.load() if llm is not None else None, self._num_added, self.metrics.take(),
                            self._embeddings)
        self._num_added, self._embeddings = 0, []
        return output

    def _embed(self, job: EmbedJob) -> list[CompletionDelta]:
        # The model runs one batch at a time: the step in flight finishes first.
        deltas = self.llm_engine.wait_for_in_flight_step() if self.llm_engine is not None else []
        try:
            pooled = self.embedding_model.embed_token_ids(job.token_ids)
            self._embeddings.append(EmbedResult(job.job_id, pooled.float().cpu().numpy()))
        except Exception as e:
            logger.exception("embedding batch failed")
            self._embeddings.append(EmbedResult(job.job_id, None, e))
        return deltas

    def run(self, commands: Connection, outputs: Connection) -> None:
        """Until `Shutdown`, or the front end went away (its pipe closed)."""
        while not self.is_stopping:
            deltas: list[CompletionDelta] = []
            # Idle: block until a command comes; busy: take what came meanwhile, then step.
            if commands.poll(0 if self.has_work else None):
                try:
                    while commands.poll(0):
                        for command in commands.recv():
                            deltas += self.apply(command)
                except EOFError:
                    logger.warning("the front end went away; the engine core stops")
                    return
            if self.has_work and not self.is_stopping:
                deltas += self.step()
            output = self.take_output(deltas)
            if not output.is_empty:
                outputs.send(output)


def run_engine_core(config: EngineConfig, commands: Connection, outputs: Connection, log_level: str) -> None:
    """The core process's entry point (spawned by `CoreClient.spawn`)."""
    # NOTE: SIGTERM/SIGINT are the front end's to handle: it drains, then sends `Shutdown`. A Ctrl-C reaches
    # the whole process group, and the core must not die under the requests being drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    import torch

    torch.manual_seed(config.seed)
    if resolve_device(config.device).type == "cpu":
        # NOTE: the front end streams tokens while the core computes; on the CPU they would share the
        # compute threads' cores, and the CPU kernels' workers spin between calls, so a step waits for
        # whichever worker the front end displaced. One core fewer for compute measured faster on the
        # shared 2-core machine (docs/operations.md, "The engine core process").
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    try:
        core = EngineCore(config)
    except Exception as e:  # noqa: BLE001 - reported to the front end, which fails its start with it
        outputs.send(CoreStartFailed(e))
        return
    # The front end froze its own heap; this process holds the model and the block pool: without this, each
    # full collection here walks them all in the middle of a step.
    freeze_startup_heap()
    outputs.send(core.ready())
    core.run(commands, outputs)
