"""Rank 0's model calls, replayed on the other ranks: each step is a small header through a pipe,
then the step's tensors broadcast over the group (input ids, positions, slots, query starts, sequence
lengths, block tables; or the hidden rows to compute logits of). Nothing per sequence is pickled.

    rank 0 (DriverModel)                        rank r (WorkerLoop)
    header (op, sizes, cache) -> pipe  ------>  waits on the pipe (idle as long as the server is)
    broadcast(tensors)              <------->   broadcast(empty tensors of the header's sizes)
    forward / compute_logits                    the same forward / compute_logits on its shard

The pipe, not a collective, carries the wait between steps: a collective would time out while the
server is idle. Within a step every collective runs under the group's timeout.

Decode steps replay CUDA graphs on every rank (`Op.GRAPH`): rank 0 announces each warm-up, capture
and replay of the graph of a batch size, and each worker runs the same phase of its own graph. The
step's broadcasts happen inside the graphs, from rank 0's persistent input buffers into the worker's,
so a replay is one header down the pipe and `graph.replay()` on each rank:

    rank 0                                      rank r
    GRAPH(capture, B) -> pipe  ------------->   capture B: broadcast into its buffers, forward,
    capture B: broadcast its buffers, forward,             its logits columns
               logits (gathered)
    GRAPH(replay, B)  -> pipe  ------------->   replay B
    replay B (the collectives meet inside)
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.distributed.group import TensorParallelGroup
from inference_service.engine.cuda_graphs import GraphPhase, StepGraph, new_graph_pool
from inference_service.engine.kv_cache import is_head_major, new_kv_cache


class Op(IntEnum):
    FORWARD = 1
    LOGITS = 2
    STOP = 3
    GRAPH = 4

_HEADER = struct.Struct("<11q")
_KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


@dataclass(frozen=True, slots=True)
class StepHeader:
    """What a worker needs to allocate the step's tensors before they are broadcast."""

    op: int
    num_tokens: int = 0  # FORWARD: T; LOGITS: rows; GRAPH: the graph's batch size
    num_seqs: int = 0
    block_table_width: int = 0
    cache_key: int = 0  # which of rank 0's KV caches (the serving one, the embeddings' scratch one)
    num_blocks: int = 0
    block_size: int = 0
    kv_dtype: int = 0
    max_seq_len: int = 0
    graph_phase: int = 0  # GRAPH: a `GraphPhase`
    kv_head_major: int = 0  # rank 0's cache layout (`kv_cache.new_kv_cache`)

    def pack(self) -> bytes:
        return _HEADER.pack(self.op, self.num_tokens, self.num_seqs, self.block_table_width, self.cache_key,
                            self.num_blocks, self.block_size, self.kv_dtype, self.max_seq_len, self.graph_phase,
                            self.kv_head_major)

    @classmethod
    def unpack(cls, data: bytes) -> StepHeader:
        return cls(*_HEADER.unpack(data))


class DriverModel:
    """Rank 0's face of a sharded `DecoderModel`: calls it as the engine does, after telling the
    workers to make the same call. Everything else reads through to the model."""

    def __init__(self, model, group: TensorParallelGroup, pipes: list, workers=None):
        self._model, self._group, self._pipes = model, group, pipes
        self.workers = workers  # the `WorkerPool` that started the other ranks
        self._is_in_graph_step = False  # the workers follow a graph phase: calls send no headers

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _send(self, header: StepHeader) -> None:
        data = header.pack()
        for pipe in self._pipes:
            pipe.send_bytes(data)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata) -> torch.Tensor:
        if not self._is_in_graph_step:
            self._send(_step_header(Op.FORWARD, input_ids.shape[0], kv_caches, metadata))
        for tensor in _step_tensors(input_ids, positions, metadata):
            self._group.broadcast(tensor.contiguous())
        return self._model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if not self._is_in_graph_step:
            self._send(StepHeader(Op.LOGITS, hidden.shape[0]))
            self._group.broadcast(hidden.contiguous())
        # NOTE: a decode graph takes the logits of every row of its forward, whose output is the same on every
        # rank (the all-reduces give every rank the same sums): the workers use their own, no broadcast.
        return self._model.compute_logits(hidden, out)

    @contextmanager
    def graph_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], phase: GraphPhase, size: int,
                   metadata: AttentionMetadata | None) -> Iterator[None]:
        """The workers run `phase` of their own decode graph of batch size `size` (warm-up and capture
        over `metadata`'s shapes) while rank 0 runs the same phase inside this block; rank 0's calls in
        it broadcast as usual but send no headers (the workers' graph bodies expect none)."""
        if metadata is None:
            header = StepHeader(Op.GRAPH, size, graph_phase=phase)
        else:
            header = _step_header(Op.GRAPH, size, kv_caches, metadata, phase)
        self._send(header)
        self._is_in_graph_step = True
        try:
            yield
        finally:
            self._is_in_graph_step = False

    def stop_workers(self) -> None:
        """Tells the workers to leave their loops (they exit)."""
        try:
            self._send(StepHeader(Op.STOP))
        except (BrokenPipeError, OSError):
            pass  # a worker already gone


def _step_header(op: Op, num_tokens: int, kv_caches, metadata: AttentionMetadata, phase: int = 0) -> StepHeader:
    k_cache = kv_caches[0][0]
    return StepHeader(op, num_tokens, metadata.seq_lens.shape[0], metadata.block_tables.shape[1], k_cache.data_ptr(),
                      k_cache.shape[0], k_cache.shape[1], _KV_DTYPES.index(k_cache.dtype), metadata.max_seq_len, phase,
                      int(is_head_major(k_cache)))


def _step_tensors(input_ids, positions, metadata: AttentionMetadata) -> list[torch.Tensor]:
    return [input_ids, positions, metadata.slot_mapping, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_tables]


class WorkerLoop:
    """A worker rank's loop: replays rank 0's calls on its shard until told to stop or rank 0 is gone."""

    def __init__(self, model, group: TensorParallelGroup, pipe, device: torch.device, dtype: torch.dtype):
        self.model, self.group, self.pipe, self.device, self.dtype = model, group, pipe, device, dtype
        self._caches: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._graphs: WorkerGraphs | None = None  # made at rank 0's first graph warm-up

    @torch.inference_mode()
    def run(self) -> None:
        while True:
            try:
                header = StepHeader.unpack(self.pipe.recv_bytes())
            except EOFError:
                return  # rank 0 is gone
            match header.op:
                case Op.FORWARD:
                    self._forward(header)
                case Op.LOGITS:
                    hidden = torch.empty((header.num_tokens, self.model.config.hidden_size), dtype=self.dtype,
                                         device=self.device)
                    self.model.compute_logits(self.group.broadcast(hidden))
                case Op.GRAPH:
                    if self._graphs is None:  # the largest batch size is captured first
                        self._graphs = WorkerGraphs(self, header.num_tokens, header.block_table_width)
                    self._graphs.step(header)
                case _:
                    return

    def _forward(self, h: StepHeader) -> None:
        dev, t, s = self.device, h.num_tokens, h.num_seqs
        input_ids, positions, slots = (torch.empty(t, dtype=torch.int64, device=dev) for _ in range(3))
        query_start_loc = torch.empty(s + 1, dtype=torch.int32, device=dev)
        seq_lens = torch.empty(s, dtype=torch.int32, device=dev)
        block_tables = torch.empty((s, h.block_table_width), dtype=torch.int32, device=dev)
        for tensor in (input_ids, positions, slots, query_start_loc, seq_lens, block_tables):
            self.group.broadcast(tensor)
        metadata = AttentionMetadata.from_step(
            slot_mapping=slots, query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
            query_start_loc_cpu=query_start_loc.tolist(), seq_lens_cpu=seq_lens.tolist(), max_seq_len=h.max_seq_len)
        self.model(input_ids, positions, self.cache_for(h), metadata)

    def cache_for(self, h: StepHeader) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's twin of rank 0's cache `h.cache_key`: its own KV heads, the same blocks."""
        caches = self._caches.get(h.cache_key)
        shape = self.model.kv_cache_shape(h.num_blocks, h.block_size)
        dtype = _KV_DTYPES[h.kv_dtype]
        head_major = bool(h.kv_head_major)
        if (caches is None or caches[0][0].shape != shape or caches[0][0].dtype != dtype
                or is_head_major(caches[0][0]) != head_major):
            caches = [(new_kv_cache(shape, dtype, self.device, head_major),
                       new_kv_cache(shape, dtype, self.device, head_major))
                      for _ in range(self.model.config.num_hidden_layers)]
            self._caches[h.cache_key] = caches
        return caches


class WorkerGraphs:
    """A worker's decode graphs: persistent buffers that the broadcasts inside the graphs fill (the
    twins of rank 0's `StepInputs` prefixes) and one `StepGraph` a batch size, sharing a memory pool."""

    def __init__(self, loop: WorkerLoop, max_batch_size: int, block_table_width: int):
        self.loop, dev = loop, loop.device
        self.input_ids, self.positions, self.slots = (torch.zeros(max_batch_size, dtype=torch.int64, device=dev)
                                                      for _ in range(3))
        self.query_start_loc = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_batch_size, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((max_batch_size, block_table_width), dtype=torch.int32, device=dev)
        self.graphs: dict[int, StepGraph] = {}
        self._pool = new_graph_pool(dev)

    def step(self, h: StepHeader) -> None:
        size, phase = h.num_tokens, GraphPhase(h.graph_phase)
        if phase == GraphPhase.REPLAY:
            self.graphs[size].replay()
            return
        caches = self.loop.cache_for(h)  # before any capture: a new cache is never allocated inside one
        metadata = AttentionMetadata.for_decode_capture(
            slot_mapping=self.slots[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], max_seq_len=h.max_seq_len)
        if phase == GraphPhase.WARMUP:
            self._body(size, caches, metadata)
            if self.loop.device.type == "cuda":
                torch.cuda.synchronize(self.loop.device)
            return
        graph = StepGraph(self.loop.device, self._pool)
        graph.capture(lambda: self._body(size, caches, metadata))
        self.graphs[size] = graph

    def _body(self, size: int, caches, metadata: AttentionMetadata) -> None:
        """Rank 0's graph body on this rank's shard: the step's inputs broadcast into the buffers, the
        forward, then this rank's columns of the logits of every row (gathered on rank 0)."""
        input_ids, positions = self.input_ids[:size], self.positions[:size]
        for tensor in _step_tensors(input_ids, positions, metadata):
            self.loop.group.broadcast(tensor)
        self.loop.model.compute_logits(self.loop.model(input_ids, positions, caches, metadata))
