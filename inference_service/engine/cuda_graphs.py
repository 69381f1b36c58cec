"""CUDA graphs of the decode step: one capture per batch size, replayed instead of ~1000 launches.

A decode-only step of B sequences runs the graph of the smallest captured size >= B; the rows past
B are padding (`StepInputs.prepare(pad_to=...)`). Each graph is captured over prefixes of the
persistent input buffers and writes the logits of every row into a prefix of one shared buffer, so
a replay is: fill the buffers, `graph.replay()`, read `logits[:B]`. The graphs share one memory pool
(captured largest first, so the smaller ones reuse its blocks).

The attention metadata captured with a graph is fixed: its host-side `max_seq_len` is the longest
context a sequence may reach, so the Triton decode kernel's split count suits every later step
(its trailing splits are empty on shorter contexts).

Tensor parallelism: `announce(phase, size, metadata)` (the `DriverModel`'s `graph_step`) has the other
ranks run the same phase of their own graph of that size, so each warm-up, capture and replay meets
its collectives on every rank.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from enum import IntEnum

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.engine.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# Below this batch size captures are 8 apart, from it on 16: a padded row costs a larger share of a small step.
_FINE_STEP_LIMIT = 256


def capture_sizes(max_batch_size: int) -> list[int]:
    """The decode batch sizes captured for `max_batch_size` (the engine passes --max-num-seqs): 1, 2, 4,
    then every multiple of 8 below 256 and every multiple of 16 from 256 on, always ending at
    `max_batch_size` itself (vLLM's list). A step pads to the next size, so padding wastes at most 7
    rows below 256 and 15 above, while the number of captures (time and graph memory at startup)
    grows by one per 16 sequences instead of per 8."""
    if max_batch_size < 1:
        raise ValueError(f"a CUDA graph batch size must be >= 1, got {max_batch_size}")
    candidates = [1, 2, 4, *range(8, _FINE_STEP_LIMIT, 8), *range(_FINE_STEP_LIMIT, max_batch_size, 16)]
    return [s for s in candidates if s < max_batch_size] + [max_batch_size]


class GraphPhase(IntEnum):
    WARMUP = 1  # an eager run: compiles and autotunes outside the capture
    CAPTURE = 2
    REPLAY = 3


Announce = Callable[[GraphPhase, int, AttentionMetadata | None], AbstractContextManager]


def _alone(phase: GraphPhase, size: int, metadata: AttentionMetadata | None) -> AbstractContextManager:
    return contextlib.nullcontext()


def new_graph_pool(device: torch.device):
    """A memory pool a device's graphs share (None on the CPU)."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepGraph:
    """One captured step: a CUDA graph on a GPU. On the CPU a stand-in whose replay runs the captured
    body again over the same buffers, collectives included, so that the capture and replay protocol of
    tensor-parallel ranks runs under gloo (tests); the engine captures nothing on the CPU itself."""

    def __init__(self, device: torch.device, pool):
        self.device, self.pool = device, pool
        self._graph: torch.cuda.CUDAGraph | None = None
        self._body: Callable[[], object] | None = None

    def capture(self, body: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """Captures `body`; returns what it returned (on a GPU, the tensor each replay rewrites)."""
        if self.device.type != "cuda":
            self._body = body
            return body()
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=self.pool):
            return body()

    def replay(self) -> None:
        if self._graph is not None:
            self._graph.replay()
        else:
            self._body()


def capture_graphs(device: torch.device, sizes: list[int],
                   prepare: Callable[[int], tuple[AttentionMetadata, Callable[[], torch.Tensor]]],
                   announce: Announce = _alone) -> tuple[dict[int, StepGraph], dict[int, torch.Tensor], int]:
    """One graph a size, largest first into one pool (the smaller ones reuse its blocks). `prepare(size)` fills
    the buffers for that size and returns (metadata, body): the body is run once eagerly (compiles and autotunes
    outside the capture), then captured. Returns (graphs, what each body returned, graph memory in bytes)."""
    is_cuda = device.type == "cuda"
    free_before = torch.cuda.mem_get_info(device)[0] if is_cuda else 0
    pool = new_graph_pool(device)
    graphs, outputs = {}, {}
    for size in sorted(sizes, reverse=True):
        metadata, body = prepare(size)
        with announce(GraphPhase.WARMUP, size, metadata):
            body()
            synchronize(device)
        graph = StepGraph(device, pool)
        with announce(GraphPhase.CAPTURE, size, metadata):
            outputs[size] = graph.capture(body)
        graphs[size] = graph
    synchronize(device)
    return graphs, outputs, free_before - torch.cuda.mem_get_info(device)[0] if is_cuda else 0


def smallest_fit(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` >= n; None if n is past the largest."""
    return sizes[bisect.bisect_left(sizes, n)] if n <= sizes[-1] else None


class DecodeGraphs:
    """Captured decode steps for `sizes` batch sizes over `inputs`' buffers."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 inputs: StepInputs, sizes: list[int], max_seq_len: int, device: torch.device,
                 announce: Announce | None = None):
        self.sizes = sorted(sizes)
        self.max_batch_size = self.sizes[-1]
        self._announce = announce or _alone

        def prepare(size: int):
            metadata = _padding_metadata(inputs, size, max_seq_len)
            arrays = inputs.arrays(size, size)
            return metadata, lambda: forward(arrays.input_ids, arrays.positions, metadata)

        start = time.perf_counter()
        # logits: batch size -> [size, vocab] float32 (what forward returned)
        self.graphs, self.logits, self.memory_bytes = capture_graphs(device, self.sizes, prepare, self._announce)
        logger.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s, %.0f MiB", len(self.sizes),
                    self.sizes[0], self.max_batch_size, time.perf_counter() - start, self.memory_bytes / 2**20)

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a decode step of `num_seqs` sequences runs at; None if none fits."""
        return smallest_fit(self.sizes, num_seqs)

    def replay(self, size: int) -> torch.Tensor:
        """Runs the graph of `size` over the buffers as they are now; its logits [size, vocab]."""
        with self._announce(GraphPhase.REPLAY, size, None):
            self.graphs[size].replay()
        return self.logits[size]


def _padding_metadata(inputs: StepInputs, size: int, max_seq_len: int) -> AttentionMetadata:
    """Metadata of `size` one-token sequences over that shape's views of the buffers, for capture. They
    are filled as padding (slot -1, seq_len 0), so the warm-up and capture runs touch no cache."""
    arrays = inputs.arrays(size, size)
    arrays.slot_mapping.fill_(-1)
    arrays.seq_lens.zero_()
    arrays.query_start_loc.copy_(torch.arange(size + 1, dtype=torch.int32))
    arrays.input_ids.zero_()
    arrays.positions.zero_()
    return AttentionMetadata.for_decode_capture(
        slot_mapping=arrays.slot_mapping, query_start_loc=arrays.query_start_loc, seq_lens=arrays.seq_lens,
        block_tables=inputs.block_tables[:size], max_seq_len=max_seq_len)
