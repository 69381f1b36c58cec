"""Rank 0's model calls, replayed on the other ranks: each step is a small header through a pipe,
then the step's tensors broadcast over the group (input ids, positions, slots, query starts, sequence
lengths, block tables; or the hidden rows to compute logits of). Nothing per sequence is pickled.

    rank 0 (DriverModel)                        rank r (WorkerLoop)
    header (op, sizes, cache) -> pipe  ------>  waits on the pipe (idle as long as the server is)
    broadcast(tensors)              <------->   broadcast(empty tensors of the header's sizes)
    forward / compute_logits                    the same forward / compute_logits on its shard

The pipe, not a collective, carries the wait between steps: a collective would time out while the
server is idle. Within a step every collective runs under the group's timeout.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.distributed.group import TensorParallelGroup


class Op(IntEnum):
    FORWARD = 1
    LOGITS = 2
    STOP = 3

_HEADER = struct.Struct("<9q")
_KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


@dataclass(frozen=True, slots=True)
class StepHeader:
    """What a worker needs to allocate the step's tensors before they are broadcast."""

    op: int
    num_tokens: int = 0  # FORWARD: T; LOGITS: rows
    num_seqs: int = 0
    block_table_width: int = 0
    cache_key: int = 0  # which of rank 0's KV caches (the serving one, the embeddings' scratch one)
    num_blocks: int = 0
    block_size: int = 0
    kv_dtype: int = 0
    max_seq_len: int = 0

    def pack(self) -> bytes:
        return _HEADER.pack(self.op, self.num_tokens, self.num_seqs, self.block_table_width, self.cache_key,
                            self.num_blocks, self.block_size, self.kv_dtype, self.max_seq_len)

    @classmethod
    def unpack(cls, data: bytes) -> StepHeader:
        return cls(*_HEADER.unpack(data))


class DriverModel:
    """Rank 0's face of a sharded `DecoderModel`: calls it as the engine does, after telling the
    workers to make the same call. Everything else reads through to the model."""

    def __init__(self, model, group: TensorParallelGroup, pipes: list, workers=None):
        self._model, self._group, self._pipes = model, group, pipes
        self.workers = workers  # the `WorkerPool` that started the other ranks

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _send(self, header: StepHeader) -> None:
        data = header.pack()
        for pipe in self._pipes:
            pipe.send_bytes(data)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], metadata: AttentionMetadata) -> torch.Tensor:
        k_cache = kv_caches[0][0]
        num_seqs = metadata.seq_lens.shape[0]
        self._send(StepHeader(Op.FORWARD, input_ids.shape[0], num_seqs, metadata.block_tables.shape[1],
                              k_cache.data_ptr(), k_cache.shape[0], k_cache.shape[1],
                              _KV_DTYPES.index(k_cache.dtype), metadata.max_seq_len))
        for tensor in _step_tensors(input_ids, positions, metadata):
            self._group.broadcast(tensor.contiguous())
        return self._model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._send(StepHeader(Op.LOGITS, hidden.shape[0]))
        self._group.broadcast(hidden.contiguous())
        return self._model.compute_logits(hidden)

    def stop_workers(self) -> None:
        """Tells the workers to leave their loops (they exit)."""
        try:
            self._send(StepHeader(Op.STOP))
        except (BrokenPipeError, OSError):
            pass  # a worker already gone


def _step_tensors(input_ids, positions, metadata: AttentionMetadata) -> list[torch.Tensor]:
    return [input_ids, positions, metadata.slot_mapping, metadata.query_start_loc, metadata.seq_lens,
            metadata.block_tables]


class WorkerLoop:
    """A worker rank's loop: replays rank 0's calls on its shard until told to stop or rank 0 is gone."""

    def __init__(self, model, group: TensorParallelGroup, pipe, device: torch.device, dtype: torch.dtype):
        self.model, self.group, self.pipe, self.device, self.dtype = model, group, pipe, device, dtype
        self._caches: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

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
        self.model(input_ids, positions, self._cache(h), metadata)

    def _cache(self, h: StepHeader) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's twin of rank 0's cache `h.cache_key`: its own KV heads, the same blocks."""
        caches = self._caches.get(h.cache_key)
        shape = self.model.kv_cache_shape(h.num_blocks, h.block_size)
        dtype = _KV_DTYPES[h.kv_dtype]
        if caches is None or caches[0][0].shape != shape or caches[0][0].dtype != dtype:
            caches = [(torch.zeros(shape, dtype=dtype, device=self.device),
                       torch.zeros(shape, dtype=dtype, device=self.device))
                      for _ in range(self.model.config.num_hidden_layers)]
            self._caches[h.cache_key] = caches
        return caches
