"""The model's per-step inputs, kept in persistent buffers and uploaded in one copy.

Each step writes its token ids, positions, cache slots, query starts, sequence lengths and block
tables into numpy views of one host staging buffer (pinned on a GPU) and copies the bytes it wrote to a
device buffer of the same layout in one asynchronous copy (a copy per array was eight a decode step,
each a few microseconds of the step's GPU time). The block tables keep one fixed place, at the top of
the buffer: a row is rewritten only where its sequence grew. A step's other arrays are packed right
below them, at offsets set by its numbers of tokens and sequences, so what it wrote is one contiguous
range. The device buffer never moves, so a CUDA graph captured over the views of a (tokens,
sequences) shape replays against whatever a later step of that shape wrote there. On the CPU the host
buffer is the device buffer and nothing is copied.

    staging bytes: ... | pending rows, sources | query starts, seq lens | slots, positions, input ids | block tables
                         <- step-dependent offsets, packed down from the tables ->                    ^ fixed

A decode step padded to a captured batch size fills its padding rows with slot -1 (nothing is
written to the cache) and seq_len 0 (the decode kernel returns zeros for them).

With async scheduling a decode row's token may still be pending: sampled by the step in flight,
its id only on the GPU. Such rows are filled on the device from that step's sampled ids (one
gather), so preparing a step never waits for the one before it. The host buffer is rewritten
only once the previous step's copy out of it has run (an event), which is at once: that
step's predecessor has been synchronised with already.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.engine.scheduler import ScheduledSeq

# The views of this many (tokens, sequences) shapes are kept; decode steps repeat a few.
_MAX_CACHED_SHAPES = 1024


class StepArrays(NamedTuple):
    """One step's arrays over the staging bytes (numpy views of the host's, or torch views of the device's)."""

    input_ids: Any  # [T] int64
    positions: Any  # [T] int64
    slot_mapping: Any  # [T] int64
    query_start_loc: Any  # [S + 1] int32
    seq_lens: Any  # [S] int32
    pending_rows: Any  # [S] int64: rows whose token is pending (the first ones used)
    pending_sources: Any  # [S] int64: where in the pending ids each one's token is


def _offsets(table_at: int, num_tokens: int, num_seqs: int) -> StepArrays:
    """Byte offsets of a step's arrays for `num_tokens` tokens and `num_seqs` sequences, packed down from
    `table_at` (8-aligned), the int64 arrays first so each stays aligned."""
    input_ids = table_at - 8 * num_tokens
    positions = input_ids - 8 * num_tokens
    slot_mapping = positions - 8 * num_tokens
    seq_lens = slot_mapping - 4 * num_seqs
    query_start_loc = seq_lens - 4 * (num_seqs + 1)
    pending_sources = (query_start_loc & ~7) - 8 * num_seqs
    pending_rows = pending_sources - 8 * num_seqs
    return StepArrays(input_ids, positions, slot_mapping, query_start_loc, seq_lens, pending_rows, pending_sources)


def _arrays(view, table_at: int, num_tokens: int, num_seqs: int) -> StepArrays:
    """`StepArrays` of a (tokens, sequences) shape, `view(offset, count, is_int64)` making each view."""
    counts = (num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs, num_seqs)
    is_int64 = (True, True, True, False, False, True, True)
    return StepArrays(*(view(at, n, wide) for at, n, wide in
                        zip(_offsets(table_at, num_tokens, num_seqs), counts, is_int64, strict=True)))


@dataclass(slots=True)
class PendingTokenIds:
    """The sampled ids of the step in flight, still on the device."""

    token_ids: torch.Tensor  # [num_sampling] int64 on the device
    row_of_seq: dict[int, int]  # seq_id -> its row in token_ids


class StepInputs:
    """Fills the persistent input buffers from a scheduled step.

    Sizes: up to `max_num_tokens` tokens and `max_num_seqs` sequences a step, each sequence at
    most `max_blocks_per_seq` blocks long."""

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device):
        self.block_size = block_size
        self.device = device
        self.block_table_width = max_blocks_per_seq
        self.is_copied = device.type == "cuda"
        # below the tables: the largest step's arrays, and 8 bytes of alignment
        self._table_at = -(-(24 * max_num_tokens + 24 * max_num_seqs + 16) // 64) * 64
        num_bytes = self._table_at + 4 * max_num_seqs * max_blocks_per_seq
        self._host = torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=self.is_copied)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(num_bytes, dtype=torch.uint8, device=device) if self.is_copied else self._host
        tables = slice(self._table_at, num_bytes)
        self._block_tables_np = self._host_np[tables].view(np.int32).reshape(max_num_seqs, max_blocks_per_seq)
        self.block_tables = self._device[tables].view(torch.int32).view(max_num_seqs, max_blocks_per_seq)
        self._host_arrays: dict[tuple[int, int], StepArrays] = {}  # (tokens, seqs) -> numpy views
        self._device_arrays: dict[tuple[int, int], StepArrays] = {}  # (tokens, seqs) -> device views
        self._copied: torch.cuda.Event | None = None  # recorded after the last step's upload
        # What each block-table row holds: (seq_id, num_preemptions) and its number of blocks
        # written. Between preemptions a block table only grows, so a row that keeps its sequence
        # gets only the new blocks (re-writing ~100 per sequence each step cost ms at 384 sequences).
        self._row_keys: list[tuple[int, int] | None] = [None] * max_num_seqs
        self._row_num_blocks = [0] * max_num_seqs

    def arrays(self, num_tokens: int, num_seqs: int) -> StepArrays:
        """The device views a step of `num_tokens` tokens and `num_seqs` sequences is uploaded to (the same
        tensors every time: graphs are captured over them)."""
        return self._cached(self._device_arrays, self._device_view, num_tokens, num_seqs)

    def _cached(self, cache: dict, view, num_tokens: int, num_seqs: int) -> StepArrays:
        arrays = cache.get((num_tokens, num_seqs))
        if arrays is None:
            if len(cache) >= _MAX_CACHED_SHAPES:  # mixed steps of every size: views are cheap to make again
                cache.clear()
            arrays = cache[num_tokens, num_seqs] = _arrays(view, self._table_at, num_tokens, num_seqs)
        return arrays

    def _device_view(self, at: int, n: int, is_int64: bool) -> torch.Tensor:
        return self._device[at:at + (8 if is_int64 else 4) * n].view(torch.int64 if is_int64 else torch.int32)

    def _numpy_view(self, at: int, n: int, is_int64: bool) -> np.ndarray:
        return self._host_np[at:at + (8 if is_int64 else 4) * n].view(np.int64 if is_int64 else np.int32)

    def prepare(self, scheduled: list[ScheduledSeq], pad_to: int | None = None,
                pending: PendingTokenIds | None = None,
                pad_tokens_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [T], positions [T], metadata) for the step, T = its number of tokens.

        `pad_to` (decode-only steps) pads the batch to that many one-token sequences; `pad_tokens_to` (one
        prompt, for a prefill graph) pads its token rows to that many, the sequence's lengths unchanged.
        `pending` holds the ids of tokens not yet on the host (decode rows of sequences sampled by the
        step in flight)."""
        if self._copied is not None:
            self._copied.synchronize()
        bs = self.block_size
        num_seqs = len(scheduled)
        num_real_tokens = sum(s.num_new_tokens for s in scheduled)
        num_tokens, num_padded_seqs = num_real_tokens, num_seqs
        if pad_to is not None and pad_to > num_seqs:
            assert num_real_tokens == num_seqs, "only decode-only steps are padded"
            num_tokens = num_padded_seqs = pad_to
        if pad_tokens_to is not None and pad_tokens_to > num_tokens:
            assert num_seqs == 1, "only a single prompt's tokens are padded"
            num_tokens = pad_tokens_to
        host = self._cached(self._host_arrays, self._numpy_view, num_tokens, num_padded_seqs)
        input_ids, positions, slots = host.input_ids, host.positions, host.slot_mapping
        query_start_loc, seq_lens, block_tables = host.query_start_loc, host.seq_lens, self._block_tables_np
        query_start_loc[0] = 0
        pending_rows, pending_sources = host.pending_rows, host.pending_sources
        row_keys, row_num_blocks = self._row_keys, self._row_num_blocks
        lo = max_num_blocks = num_pending = 0
        for i, s in enumerate(scheduled):
            seq, start, n = s.seq, s.start, s.num_new_tokens
            end = start + n
            block_table = seq.block_table
            num_blocks = len(block_table)
            key = (seq.seq_id, seq.num_preemptions)
            written = row_num_blocks[i] if row_keys[i] == key else 0
            if num_blocks > written:
                block_tables[i, written:num_blocks] = block_table[written:]
            row_keys[i], row_num_blocks[i] = key, num_blocks
            max_num_blocks = max(max_num_blocks, num_blocks)
            seq_lens[i] = end
            query_start_loc[i + 1] = lo + n
            if start == len(seq.token_ids):  # decode of a pending token
                pending_rows[num_pending] = lo
                pending_sources[num_pending] = pending.row_of_seq[seq.seq_id]
                num_pending += 1
                positions[lo] = start
                slots[lo] = block_table[start // bs] * bs + start % bs
            elif n == 1:  # decode: skip the numpy temporaries
                input_ids[lo] = seq.token_ids[start]
                positions[lo] = start
                slots[lo] = block_table[start // bs] * bs + start % bs
            else:
                input_ids[lo:lo + n] = seq.token_ids[start:end]
                pos = np.arange(start, end)
                positions[lo:lo + n] = pos
                slots[lo:lo + n] = block_tables[i, pos // bs] * bs + pos % bs
            lo += n
        if num_tokens > lo:  # padding rows: no cache slot, position 0, and (padded sequences) length 0
            slots[lo:], input_ids[lo:], positions[lo:] = -1, 0, 0
            seq_lens[num_seqs:] = 0
            query_start_loc[num_seqs + 1:] = np.arange(lo + 1, num_padded_seqs + 1)
        arrays = self.arrays(num_tokens, num_padded_seqs)
        self._upload(num_tokens, num_padded_seqs, num_pending)
        device_input_ids = arrays.input_ids
        if num_pending:
            rows, sources = arrays.pending_rows[:num_pending], arrays.pending_sources[:num_pending]
            if self.is_copied:
                from kernels.index_copy import gather_scatter  # noqa: PLC0415 - Triton on GPUs only

                gather_scatter(device_input_ids, rows, pending.token_ids, sources)
            else:
                device_input_ids.index_copy_(0, rows, pending.token_ids.index_select(0, sources))
        metadata = AttentionMetadata.from_step(
            slot_mapping=arrays.slot_mapping, query_start_loc=arrays.query_start_loc, seq_lens=arrays.seq_lens,
            # Columns past a sequence's own blocks hold stale but valid block ids: every reader stops at its
            # length. A GPU step reads every column (graphs read the full width), the CPU the ones in use.
            block_tables=(self.block_tables[:num_padded_seqs] if self.is_copied
                          else self.block_tables[:num_padded_seqs, :max(max_num_blocks, 1)]),
            query_start_loc_cpu=query_start_loc.tolist(),
            seq_lens_cpu=seq_lens.tolist(),  # padding rows are 0
        )
        return device_input_ids, arrays.positions, metadata

    def upload_range(self, num_tokens: int, num_seqs: int, num_pending: int) -> tuple[int, int]:
        """The staging bytes [start, end) a step of this shape writes: its arrays (the pending rows' only when
        some are pending) and its sequences' block-table rows."""
        offsets = _offsets(self._table_at, num_tokens, num_seqs)
        start = offsets.pending_rows if num_pending else offsets.query_start_loc  # the lowest array written
        return start, self._table_at + 4 * num_seqs * self.block_table_width

    def _upload(self, num_tokens: int, num_seqs: int, num_pending: int) -> None:
        """Copies what a step of this shape wrote to the device, in one copy."""
        if not self.is_copied:
            return
        start, end = self.upload_range(num_tokens, num_seqs, num_pending)
        self._device[start:end].copy_(self._host[start:end], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
