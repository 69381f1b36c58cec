"""CUDA graphs of a whole fresh prompt's prefill: one capture per padded length, replayed instead of ~450 launches.

An eager prefill step launches every kernel of every layer from Python (~450 for Llama-3-8B); at a 1k prompt
that host work (~25-35 ms) outlasts the GPU's (21.5 ms on an H100), so the time to first token is the host's
(bench/results/h100-2026-11-26/served_core_profile_1k_334618f.txt). A step that is one sequence's whole prompt
(nothing cached before it, its last token sampled: what a request on an idle or lightly loaded server gets)
replays the graph of the smallest captured length >= its own instead.

Padding: the prompt's tokens fill the first rows of the persistent buffers and the rest are padding rows
(slot -1: never written to the cache; position 0). Attention is causal, so a real row sees only real keys,
and the device-side `query_start_loc` / `seq_lens` hold the real length (the paged kernels stop there). The
graph keeps the logits of one row, picked by a device index the replay sets to the prompt's last token.
Lengths are `PREFILL_GRAPH_STEP` apart, so padding costs at most that many rows of compute.

Tensor parallelism keeps eager prefills (its ranks would have to follow each replay).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.engine.cuda_graphs import capture_graphs, smallest_fit
from inference_service.engine.step_inputs import StepInputs

logger = logging.getLogger(__name__)

PREFILL_GRAPH_STEP = 128  # tokens between captured lengths


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Captured prompt lengths: every multiple of PREFILL_GRAPH_STEP up to `max_tokens` (rounded down)."""
    return list(range(PREFILL_GRAPH_STEP, max_tokens + 1, PREFILL_GRAPH_STEP))


class PrefillGraphs:
    """Captured single-prompt prefill steps of `sizes` tokens over `inputs`' buffers.

    `forward(input_ids, positions, metadata, last_row)` is the captured body: the model's forward and the
    logits of row `last_row` (a [1] int64 device tensor) into a [1, vocab] buffer it returns."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor],
                 inputs: StepInputs, sizes: list[int], device: torch.device):
        if not sizes:
            raise ValueError("PrefillGraphs needs at least one length")
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.inputs = inputs
        self.last_row = torch.zeros(1, dtype=torch.int64, device=device)  # the prompt's last row, set a replay

        def prepare(size: int):
            metadata = self._capture_metadata(size)
            arrays = inputs.arrays(size, 1)
            return metadata, lambda: forward(arrays.input_ids, arrays.positions, metadata, self.last_row)

        start = time.perf_counter()
        self.graphs, self.logits, self.memory_bytes = capture_graphs(device, self.sizes, prepare)
        logger.info("captured %d prefill CUDA graphs (prompts of %d..%d tokens) in %.1f s, %.0f MiB", len(self.sizes),
                    self.sizes[0], self.max_tokens, time.perf_counter() - start, self.memory_bytes / 2**20)

    def padded_size(self, num_tokens: int) -> int | None:
        """The captured length a prompt of `num_tokens` runs at; None if it is longer than every one."""
        return smallest_fit(self.sizes, num_tokens)

    def replay(self, size: int, num_tokens: int) -> torch.Tensor:
        """Runs the graph of `size` over the buffers as `StepInputs.prepare(pad_tokens_to=size)` left them for
        a prompt of `num_tokens`; returns the logits of its last token [1, vocab]."""
        self.last_row.fill_(num_tokens - 1)
        self.graphs[size].replay()
        return self.logits[size]

    def _capture_metadata(self, size: int) -> AttentionMetadata:
        """One sequence of `size` new tokens over that shape's views of the buffers, filled as padding (slot -1),
        so the warm-up and capture runs write nothing to the cache. The host side (the kernels' grids, the dense
        prefill's span) is the padded length's; the device side is rewritten by every step."""
        arrays = self.inputs.arrays(size, 1)
        arrays.slot_mapping.fill_(-1)
        arrays.input_ids.zero_()
        arrays.positions.zero_()
        arrays.query_start_loc.copy_(torch.tensor([0, size], dtype=torch.int32))
        arrays.seq_lens.fill_(size)
        return AttentionMetadata.from_step(
            slot_mapping=arrays.slot_mapping, query_start_loc=arrays.query_start_loc, seq_lens=arrays.seq_lens,
            block_tables=self.inputs.block_tables[:1], query_start_loc_cpu=[0, size], seq_lens_cpu=[size])
