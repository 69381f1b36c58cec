"""What travels between the gRPC front end and the engine core process (pickled over pipes).

Front end -> core: lists of commands (`AddRequest`, `AbortRequest` from commands.py, `EmbedJob`,
`Shutdown`), applied between two steps. Core -> front end: `CoreReady` (or `CoreStartFailed`) once,
then one `StepOutput` per step that produced anything: every sequence's new tokens of the step at once,
never one message per token per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from inference_service.engine.embedding_model import EmbeddingModelSpec
from inference_service.engine.info import EngineInfo, EngineLoad, ModelInfo
from inference_service.engine.request import CompletionDelta
from inference_service.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class EmbedJob:
    """Embed token-id sequences between two steps; answered by an `EmbedResult` with the same `job_id`."""

    job_id: int
    token_ids: list[list[int]]


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Abort whatever still runs, send its last deltas, exit."""


@dataclass(frozen=True, slots=True)
class CoreReady:
    """The core loaded its model: what the front end needs to validate, tokenize and answer GetModelInfo."""

    model: ModelInfo
    info: EngineInfo | None  # None: an encoder, which only embeds
    tokenizer: Tokenizer  # with --chat-template applied
    embedding: EmbeddingModelSpec
    max_embed_input_tokens: int


@dataclass(frozen=True, slots=True)
class CoreStartFailed:
    """The core could not start (bad model path, unsupported model); the front end raises `error`."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class EmbedResult:
    job_id: int
    embeddings: np.ndarray | None  # [num_inputs, hidden] float32, pooled, not normalized
    error: BaseException | None = None


@dataclass(slots=True)
class StepOutput:
    """Everything one pass of the core's loop produced."""

    deltas: list[CompletionDelta]
    load: EngineLoad | None  # None: an encoder
    num_added: int  # `AddRequest`s taken since the previous output (the front end's waiting-queue bound)
    metric_events: list[tuple]  # `MetricsRecorder` events, recorded by the front end's `EngineMetrics`
    embeddings: list[EmbedResult] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.deltas or self.num_added or self.metric_events or self.embeddings)
