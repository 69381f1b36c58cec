"""Embeddings: inputs from every request and stream batched together, computed off the event loop.

Each `embed()` call tokenizes and validates its inputs on the event loop, then queues them one
input at a time. A batching thread takes as many queued inputs as fit in the token budget (from
whatever requests they belong to), runs one forward pass over them packed, pools each input, and
completes a request once all of its inputs are done::

    request A: a0 a1 a2      queue: a0 a1 a2 b0 c0 c1 ...   batch 1: [a0 a1 a2 b0 c0]   -> A, B done
    request B: b0                                            batch 2: [c1 ...]           -> C done
    request C: c0 c1

Encoders (BERT) run on this thread. Decoders run through `run_on_model_thread` (the generation
engine's thread, between steps) with a private scratch KV cache: the attention backend keeps
per-step state, and the paged cache of running generations is never touched.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.errors import (EngineError, InvalidRequestError, ResourceExhaustedError,
                                      ShuttingDownError)
from inference_service.model.bert import PackedBatch
from inference_service.model.loader import LoadedModel
from inference_service.model.pooling import PoolingConfig, finish_embeddings, pool

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


class EmbeddingEngine:
    """Batches embedding inputs across requests; `start()` inside the event loop, `await stop()` at the end."""

    def __init__(self, loaded: LoadedModel, *, device: torch.device, dtype: torch.dtype, max_input_tokens: int,
                 pooling: PoolingConfig, max_batch_tokens: int = 8192, max_batch_size: int = 256,
                 max_pending_inputs: int = 65536, block_size: int = 16,
                 run_on_model_thread: Callable[[Callable[[], Any]], concurrent.futures.Future] | None = None):
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.device, self.dtype = device, dtype
        self.pooling = pooling
        self.max_input_tokens = max_input_tokens
        # One input of the longest allowed length must always fit in a batch.
        self.max_batch_tokens = max(max_batch_tokens, max_input_tokens)
        self.max_batch_size = max_batch_size
        self.max_pending_inputs = max_pending_inputs
        self.block_size = block_size
        self.embedding_dimensions = loaded.config.hidden_size
        self._run_on_model_thread = run_on_model_thread
        self._scratch_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # decoders only, made lazily
        self._pending: collections.deque[tuple[_Job, int]] = collections.deque()
        self._jobs: set[_Job] = set()
        self._wakeup = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.is_draining = False

    @property
    def num_active_requests(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="embedding-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stops the batching thread; requests still waiting fail with UNAVAILABLE."""
        self._stopped = True
        self._wakeup.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        for job in list(self._jobs):
            if not job.future.done():
                job.future.set_exception(ShuttingDownError("the engine is shutting down"))

    # ---- the event loop side -------------------------------------------------------------------

    def tokenize_inputs(self, inputs: list[str | list[int]], truncate: bool) -> list[list[int]]:
        """Token ids of every input; too long without `truncate` -> InvalidRequestError naming the limit."""
        if not inputs:
            raise InvalidRequestError("inputs must not be empty", field="inputs")
        limit, vocab = self.max_input_tokens, self.loaded.config.vocab_size
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
        if self.is_draining or self._stopped:
            raise ShuttingDownError("the engine is shutting down and accepts no new requests")
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
        self._wakeup.set()
        try:
            return await job.future
        finally:
            job.cancelled = True  # the batching thread skips whatever of it is still queued
            self._jobs.discard(job)

    # ---- the batching thread -------------------------------------------------------------------

    def _next_batch(self) -> list[tuple[_Job, int]]:
        batch: list[tuple[_Job, int]] = []
        num_tokens = 0
        while self._pending and len(batch) < self.max_batch_size:
            job, index = self._pending[0]
            if job.cancelled:
                self._pending.popleft()
                continue
            n = len(job.token_ids[index])
            if batch and num_tokens + n > self.max_batch_tokens:
                break
            self._pending.popleft()
            batch.append((job, index))
            num_tokens += n
        return batch

    def _run(self) -> None:
        while not self._stopped:
            batch = self._next_batch()
            if not batch:
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            seqs = [job.token_ids[index] for job, index in batch]
            try:
                pooled = self._call_model(lambda: self.embed_token_ids(seqs))  # [B, H]
            except Exception as e:  # noqa: BLE001 - reported to the requests, the loop goes on
                logger.exception("embedding batch failed")
                error = e if isinstance(e, EngineError) else EngineError(f"embedding failed: {type(e).__name__}: {e}")
                for job in {job for job, _ in batch}:
                    job.cancelled = True
                    self._loop.call_soon_threadsafe(_set_exception, job.future, error)
                continue
            for row, (job, index) in enumerate(batch):
                job.pooled[index] = pooled[row]
                job.num_pending -= 1
                if job.num_pending == 0 and not job.cancelled:
                    self._loop.call_soon_threadsafe(_set_result, job.future, self._finish(job))

    def _finish(self, job: _Job) -> EmbeddingResult:
        opts = job.options
        normalize = self.pooling.normalize if opts.normalize is None else opts.normalize
        embeddings = finish_embeddings(torch.stack(job.pooled), normalize, opts.dimensions)
        return EmbeddingResult(embeddings.cpu(), [len(ids) for ids in job.token_ids])

    def _call_model(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self._run_on_model_thread is None:
            return fn()
        future = self._run_on_model_thread(fn)
        while True:
            try:
                return future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if self._stopped:
                    future.cancel()
                    raise ShuttingDownError("the engine is shutting down") from None

    # ---- the model -----------------------------------------------------------------------------

    @torch.inference_mode()
    def embed_token_ids(self, seqs: list[list[int]]) -> torch.Tensor:
        """Pooled, not yet normalized embeddings of token-id sequences: [len(seqs), hidden] float32."""
        lens = [len(s) for s in seqs]
        input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=self.device)
        if self.loaded.is_encoder:
            batch = PackedBatch.build(lens, self.device)
            hidden = self.model(input_ids, batch)  # [T, H]
            return pool(hidden, batch.cu_seqlens, self.pooling.mode)
        positions, metadata = self._decoder_metadata(lens)
        hidden = self.model(input_ids, positions, self._scratch_cache(), metadata)  # [T, H]
        return pool(hidden, metadata.query_start_loc_cpu, self.pooling.mode)

    def _scratch_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The decoder's private KV cache: room for one full batch, each sequence in whole blocks."""
        if self._scratch_kv is None:
            num_blocks = -(-self.max_batch_tokens // self.block_size) + self.max_batch_size
            shape = self.model.kv_cache_shape(num_blocks, self.block_size)
            self._scratch_kv = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                                for _ in range(self.loaded.config.num_hidden_layers)]
        return self._scratch_kv

    def _decoder_metadata(self, lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """A fresh prefill of every sequence into consecutive scratch blocks (no cached prefix)."""
        bs, dev = self.block_size, self.device
        blocks_per_seq = [-(-n // bs) for n in lens]
        max_blocks = max(blocks_per_seq)
        block_tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
        positions, slots, first_block, cu = [], [], 0, [0]
        for i, (n, num_blocks) in enumerate(zip(lens, blocks_per_seq)):
            block_tables[i, :num_blocks] = torch.arange(first_block, first_block + num_blocks)
            pos = torch.arange(n)
            positions.append(pos)
            slots.append(first_block * bs + pos)  # the sequence's blocks are consecutive
            first_block += num_blocks
            cu.append(cu[-1] + n)
        metadata = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            query_start_loc_cpu=cu,
            seq_lens_cpu=list(lens),
        )
        return torch.cat(positions).to(dev), metadata


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def create_embedding_engine(loaded: LoadedModel, *, device: torch.device, dtype: torch.dtype,
                            pooling_mode: str | None = None, max_model_len: int | None = None,
                            block_size: int = 16,
                            run_on_model_thread: Callable[[Callable[[], Any]], concurrent.futures.Future] | None = None,
                            ) -> EmbeddingEngine:
    """The embedding engine for a loaded model.

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
    max_batch_tokens = 8192 if loaded.is_encoder else limit
    max_batch_size = 256 if loaded.is_encoder else 32
    return EmbeddingEngine(loaded, device=device, dtype=dtype, max_input_tokens=limit, pooling=pooling,
                           max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size, block_size=block_size,
                           run_on_model_thread=run_on_model_thread)
