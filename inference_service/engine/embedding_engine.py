"""Embeddings: inputs from every request and stream batched together, computed off the event loop.

Each `embed()` call tokenizes and validates its inputs on the event loop, then queues them one
input at a time. A batching thread takes as many queued inputs as fit in the token budget (from
whatever requests they belong to), runs one forward pass over them packed, pools each input, and
completes a request once all of its inputs are done::

    request A: a0 a1 a2      queue: a0 a1 a2 b0 c0 c1 ...   batch 1: [a0 a1 a2 b0 c0]   -> A, B done
    request B: b0                                            batch 2: [c1 ...]           -> C done
    request C: c0 c1

Encoders (BERT) run on this thread. A decoder that also generates runs each batch as an `EmbedBatch`
job on the generation engine's thread, between steps: the attention backend keeps per-step state,
so the model never runs on two threads at once (`EmbeddingModel` keeps a scratch KV cache, so
the paged cache of running generations is never touched).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from inference_service.engine.background_loop import BackgroundLoop
from inference_service.engine.commands import EmbedBatch
from inference_service.engine.embedding_model import EmbeddingModel, EmbeddingModelSpec
from inference_service.errors import EngineError, InvalidRequestError, ResourceExhaustedError, ShuttingDownError
from inference_service.model.loader import LoadedModel
from inference_service.model.pooling import PoolingConfig, finish_embeddings

if TYPE_CHECKING:
    from inference_service.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EmbedOptions:
    """Per-request options (see `EmbedRequest` in the proto)."""

    truncate: bool = False  # cut inputs longer than the limit instead of failing
    normalize: bool | None = None  # L2-normalize; None = the model's pooling configuration
    dimensions: int = 0  # keep the first `dimensions` values (Matryoshka); 0 = all


@dataclass(slots=True)
class EmbeddingResult:
    embeddings: torch.Tensor  # [num_inputs, dimensions] float32 on the CPU
    num_tokens: list[int]  # tokens of each input after truncation

    @property
    def prompt_tokens(self) -> int:
        return sum(self.num_tokens)


@dataclass(eq=False)
class _Job:
    token_ids: list[list[int]]
    options: EmbedOptions
    future: asyncio.Future
    pooled: list[torch.Tensor | None] = field(default_factory=list)
    num_pending: int = 0
    cancelled: bool = False


class EmbeddingEngine(BackgroundLoop):
    """Batches embedding inputs across requests; `start()` inside the event loop, `await stop()` at the end.

    With `generation_engine`, each batch runs as an `EmbedBatch` job on that engine's thread (or in the engine
    core process, whose `EmbeddingModelSpec` then stands in for the model here)."""

    def __init__(self, model: EmbeddingModel | EmbeddingModelSpec, *, max_input_tokens: int, max_pending_inputs: int = 65536,
                 generation_engine: AsyncEngine | None = None):
        super().__init__("embedding-loop")
        self.model = model
        self.tokenizer = model.tokenizer
        self.vocab_size = model.vocab_size
        self.max_input_tokens = max_input_tokens
        self.max_pending_inputs = max_pending_inputs
        self.embedding_dimensions = model.embedding_dimensions
        self._generation_engine = generation_engine
        if generation_engine is not None:
            generation_engine.serve_embeddings(model)
        self._pending: collections.deque[tuple[_Job, int]] = collections.deque()
        self._jobs: set[_Job] = set()

    @property
    def num_active_requests(self) -> int:
        return len(self._jobs)

    async def stop(self) -> None:
        """Stops the batching thread; requests still waiting fail with UNAVAILABLE."""
        await super().stop()
        for job in list(self._jobs):
            if not job.future.done():
                job.future.set_exception(ShuttingDownError("the engine is shutting down"))

    # ---- the event loop side -------------------------------------------------------------------

    def tokenize_inputs(self, inputs: list[str | list[int]], truncate: bool) -> list[list[int]]:
        """Token ids of every input; too long without `truncate` -> InvalidRequestError naming the limit."""
        if not inputs:
            raise InvalidRequestError("inputs must not be empty", field="inputs")
        limit, vocab = self.max_input_tokens, self.vocab_size
        result = []
        for i, item in enumerate(inputs):
            where = f"inputs[{i}]"
            if isinstance(item, str):
                ids = self.tokenizer.encode(item, max_length=limit if truncate else None)
            else:
                ids = list(item[:limit] if truncate else item)
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise InvalidRequestError(f"{where}.token_ids holds {bad}, outside the vocabulary (size {vocab})",
                                              field=f"{where}.token_ids")
            if not ids:
                raise InvalidRequestError(f"{where} is empty (0 tokens)", field=where)
            if len(ids) > limit:
                raise InvalidRequestError(
                    f"{where} has {len(ids)} tokens, more than the model's limit of {limit} tokens; "
                    f"shorten it or set truncate", field=where)
            result.append(ids)
        return result

    async def embed(self, inputs: list[str | list[int]], options: EmbedOptions) -> EmbeddingResult:
        """Embeds every input (in order); raises `EngineError` for a bad request."""
        self.check_accepting()
        if options.dimensions > self.embedding_dimensions:
            raise InvalidRequestError(
                f"dimensions = {options.dimensions} exceeds the model's embedding size {self.embedding_dimensions}",
                field="dimensions")
        token_ids = self.tokenize_inputs(inputs, options.truncate)
        if len(self._pending) + len(token_ids) > self.max_pending_inputs:
            raise ResourceExhaustedError(
                f"the embedding queue is full ({self.max_pending_inputs} inputs); retry later")
        job = _Job(token_ids, options, self._loop.create_future(), [None] * len(token_ids), len(token_ids))
        self._jobs.add(job)
        self._pending.extend((job, i) for i in range(len(token_ids)))
        self._wake()
        try:
            return await job.future
        finally:
            job.cancelled = True  # the batching thread skips whatever of it is still queued
            self._jobs.discard(job)

    # ---- the batching thread -------------------------------------------------------------------

    def _next_batch(self) -> list[tuple[_Job, int]]:
        batch: list[tuple[_Job, int]] = []
        num_tokens = 0
        while self._pending and len(batch) < self.model.max_batch_size:
            job, index = self._pending[0]
            if job.cancelled:
                self._pending.popleft()
                continue
            n = len(job.token_ids[index])
            if batch and num_tokens + n > self.model.max_batch_tokens:
                break
            self._pending.popleft()
            batch.append((job, index))
            num_tokens += n
        return batch

    def _run_once(self) -> bool:
        batch = self._next_batch()
        if not batch:
            return False
        seqs = [job.token_ids[index] for job, index in batch]
        try:
            pooled = self._embed(seqs)  # [B, H]
        except Exception as e:  # noqa: BLE001 - reported to the requests, the loop goes on
            logger.exception("embedding batch failed")
            error = e if isinstance(e, EngineError) else EngineError(f"embedding failed: {type(e).__name__}: {e}")
            for job in {job for job, _ in batch}:
                job.cancelled = True
                self._call_in_event_loop(_set_exception, job.future, error)
            return True
        for row, (job, index) in enumerate(batch):
            job.pooled[index] = pooled[row]
            job.num_pending -= 1
            if job.num_pending == 0 and not job.cancelled:
                self._call_in_event_loop(_set_result, job.future, self._finish(job))
        return True

    def _finish(self, job: _Job) -> EmbeddingResult:
        opts = job.options
        normalize = self.model.pooling.normalize if opts.normalize is None else opts.normalize
        embeddings = finish_embeddings(torch.stack(job.pooled), normalize, opts.dimensions)
        return EmbeddingResult(embeddings.cpu(), [len(ids) for ids in job.token_ids])

    def _embed(self, seqs: list[list[int]]) -> torch.Tensor:
        if self._generation_engine is None:
            return self.model.embed_token_ids(seqs)
        job = EmbedBatch(seqs)
        self._generation_engine.send(job)
        while True:
            try:
                return job.result.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if self._stopped:
                    job.result.cancel()
                    raise ShuttingDownError("the engine is shutting down") from None


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def create_embedding_model(loaded: LoadedModel, *, device: torch.device, dtype: torch.dtype,
                           pooling_mode: str | None = None, max_model_len: int | None = None,
                           block_size: int = 16) -> tuple[EmbeddingModel, int]:
    """The embedding model of a loaded model and its input limit (tokens).

    Pooling: the folder's sentence-transformers configuration, else last-token + L2 for decoders;
    `pooling_mode` (`--embedding-pooling`) overrides the mode. Input limit: the sentence-transformers
    `max_seq_length` of an encoder (else its position embeddings), the context length of a decoder;
    `max_model_len` lowers it."""
    pooling = loaded.pooling or PoolingConfig(mode="last", normalize=True)
    if pooling_mode is not None:
        pooling = PoolingConfig(mode=pooling_mode, normalize=pooling.normalize,
                                max_seq_length=pooling.max_seq_length)
    limit = loaded.config.max_position_embeddings
    if loaded.is_encoder and pooling.max_seq_length:
        limit = min(limit, pooling.max_seq_length)
    if max_model_len:
        limit = min(limit, max_model_len)
    # NOTE: a decoder's scratch cache holds one full batch, so its budget stays at one longest input.
    # One input of the longest allowed length must always fit in a batch.
    max_batch_tokens = max(8192, limit) if loaded.is_encoder else limit
    max_batch_size = 256 if loaded.is_encoder else 32
    model = EmbeddingModel(loaded, device=device, dtype=dtype, pooling=pooling, max_batch_tokens=max_batch_tokens,
                           max_batch_size=max_batch_size, block_size=block_size)
    return model, limit


def create_embedding_engine(loaded: LoadedModel, *, device: torch.device, dtype: torch.dtype,
                            pooling_mode: str | None = None, max_model_len: int | None = None,
                            block_size: int = 16, generation_engine: AsyncEngine | None = None) -> EmbeddingEngine:
    """The embedding engine for a loaded model (see `create_embedding_model`). `generation_engine`: the
    decoder's generation engine, whose thread then runs the embedding batches."""
    model, limit = create_embedding_model(loaded, device=device, dtype=dtype, pooling_mode=pooling_mode,
                                          max_model_len=max_model_len, block_size=block_size)
    return EmbeddingEngine(model, max_input_tokens=limit, generation_engine=generation_engine)
