"""The model's per-step inputs, kept in persistent buffers.

Each step writes its token ids, positions, cache slots and block tables into numpy views of host
buffers (pinned on a GPU) and copies the used prefix of each to a device buffer of the same shape,
one asynchronous copy per tensor. The device buffers never move, so a CUDA graph captured over a
prefix of them replays against whatever a later step wrote there. On the CPU the host buffer is the
device buffer and nothing is copied.

A decode step padded to a captured batch size fills its padding rows with slot -1 (nothing is
written to the cache) and seq_len 0 (the decode kernel returns zeros for them).

With async scheduling a decode row's token may still be pending: sampled by the step in flight,
its id only on the GPU. Such rows are filled on the device from that step's sampled ids (one
gather), so preparing a step never waits for the one before it. The host buffers are rewritten
only once the previous step's copies out of them have run (an event), which is at once: that
step's predecessor has been synchronised with already.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference_service.attention.metadata import AttentionMetadata
from inference_service.engine.scheduler import ScheduledSeq


class _Buffer:
    """A host tensor with a numpy view and its device twin (the same tensor on the CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_gpu)
        self.np = self.host.numpy()
        self.device = torch.zeros(shape, dtype=dtype, device=device) if on_gpu else self.host
        self.is_copied = on_gpu

    def upload(self, n: int) -> torch.Tensor:
        """The device buffer's first n rows, after copying the host's first n rows into them."""
        if self.is_copied:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


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
        self.input_ids = _Buffer((max_num_tokens,), torch.int64, device)
        self.positions = _Buffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = _Buffer((max_num_tokens,), torch.int64, device)
        self.query_start_loc = _Buffer((max_num_seqs + 1,), torch.int32, device)
        self.seq_lens = _Buffer((max_num_seqs,), torch.int32, device)
        self.block_tables = _Buffer((max_num_seqs, max_blocks_per_seq), torch.int32, device)
        # Rows whose token is pending, and where in the pending ids each one's token is.
        self.pending_rows = _Buffer((max_num_seqs,), torch.int64, device)
        self.pending_sources = _Buffer((max_num_seqs,), torch.int64, device)
        self._copied: torch.cuda.Event | None = None  # recorded after the last step's uploads
        # What each block-table row holds: (seq_id, num_preemptions) and its number of blocks
        # written. Between preemptions a block table only grows, so a row that keeps its sequence
        # gets only the new blocks (re-writing ~100 per sequence each step cost ms at 384 sequences).
        self._row_keys: list[tuple[int, int] | None] = [None] * max_num_seqs
        self._row_num_blocks = [0] * max_num_seqs

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
        input_ids, positions, slots = self.input_ids.np, self.positions.np, self.slot_mapping.np
        query_start_loc, seq_lens, block_tables = self.query_start_loc.np, self.seq_lens.np, self.block_tables.np
        query_start_loc[0] = 0
        pending_rows, pending_sources = self.pending_rows.np, self.pending_sources.np
        row_keys, row_num_blocks = self._row_keys, self._row_num_blocks
        lo = max_query_len = max_num_blocks = num_pending = 0
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
            max_query_len = max(max_query_len, n)
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
        num_tokens = lo
        if pad_to is not None and pad_to > num_seqs:
            assert max_query_len == 1, "only decode-only steps are padded"
            slots[num_tokens:pad_to] = -1
            input_ids[num_tokens:pad_to] = 0
            positions[num_tokens:pad_to] = 0
            seq_lens[num_seqs:pad_to] = 0
            query_start_loc[num_seqs + 1:pad_to + 1] = np.arange(num_tokens + 1, pad_to + 1)
            num_seqs = num_tokens = pad_to
        if pad_tokens_to is not None and pad_tokens_to > num_tokens:
            assert num_seqs == 1, "only a single prompt's tokens are padded"
            slots[num_tokens:pad_tokens_to] = -1
            input_ids[num_tokens:pad_tokens_to] = 0
            positions[num_tokens:pad_tokens_to] = 0
            num_tokens = pad_tokens_to
        device_input_ids = self.input_ids.upload(num_tokens)
        if num_pending:
            rows, sources = self.pending_rows.upload(num_pending), self.pending_sources.upload(num_pending)
            device_input_ids.index_copy_(0, rows, pending.token_ids.index_select(0, sources))
        metadata = AttentionMetadata.from_step(
            slot_mapping=self.slot_mapping.upload(num_tokens),
            query_start_loc=self.query_start_loc.upload(num_seqs + 1),
            seq_lens=self.seq_lens.upload(num_seqs),
            block_tables=self._upload_block_tables(num_seqs, max_num_blocks),
            query_start_loc_cpu=query_start_loc[:num_seqs + 1].tolist(),
            seq_lens_cpu=seq_lens[:num_seqs].tolist(),  # padding rows are 0
        )
        device_positions = self.positions.upload(num_tokens)
        if self.input_ids.is_copied:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return device_input_ids, device_positions, metadata

    def _upload_block_tables(self, num_seqs: int, num_blocks: int) -> torch.Tensor:
        """[num_seqs, width] int32. On a GPU every column is copied (graphs read the full width);
        on the CPU only the columns in use are viewed. Columns past a sequence's own blocks hold
        stale but valid block ids: every reader stops at the sequence's length."""
        table = self.block_tables
        if table.is_copied:
            return table.upload(num_seqs)
        return table.device[:num_seqs, :max(num_blocks, 1)]
