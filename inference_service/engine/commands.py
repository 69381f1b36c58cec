"""What the event loop asks of the engine thread: typed commands, applied between two steps.

Each command is data (what the process split of the engine core will put on the wire); the engine
thread handles them with `match`, and a command of any other type is a programming error."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from inference_service.engine.request import EngineRequest


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a processed request."""

    request: EngineRequest


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """End a request's unfinished sequences (its client went away or cancelled it)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class EmbedBatch:
    """Embed token-id sequences with the decoder, between two steps (the model runs one batch at a time).

    `result` gets the pooled, not yet normalized embeddings: [len(token_ids), hidden] float32."""

    token_ids: list[list[int]]
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future, compare=False)


EngineCommand = AddRequest | AbortRequest | EmbedBatch
ENGINE_COMMAND_TYPES = (AddRequest, AbortRequest, EmbedBatch)
