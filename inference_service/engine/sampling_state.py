"""Per-row sampling parameters and output history that persist across steps, on the device.

Like the block tables, each sampling sequence holds one row slot for as long as it runs: the slot's
parameters (temperature, top-p, top-k, min-p, penalties, logit bias, generator) are written once when
the row is added and overwritten when the slot is reused, not rebuilt from Python lists every step.
A step gathers its rows from these tensors by one uploaded slot index.

The output history that penalties read is on the device too: a row's prompt-token mask and output
token counts are written from the host when it is added, and every step adds its sampled tokens on
the device (`record_sampled`), so a penalty row never waits for the step before it::

    slot:            0      1      2      3   ...  max_num_rows - 1
    params [R, 6]:  row    free   row    row        (temperature, top_p, min_p, rep., freq., pres.)
    counts [R, V]:  output token counts (allocated with the first row that has a penalty)
    seen   [R, V]:  prompt tokens (repetition penalty rows)
    bias   [R, V]:  logit bias (allocated with the first row that has one)
    allowed [R, V]: allowed_token_ids (allocated with the first row that has them)

Bad words are checked on the host each step against the row's output so far (`banned_last_tokens`):
a row whose bad words span several tokens needs its previous token on the host, as a format does.

NOTE: the [R, V] tensors are allocated on first use: a server that never sees a penalty or a bias
keeps the memory; on a GPU they come out of the headroom `gpu_memory_fraction` leaves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import torch

from inference_service.engine.logits_processors import (
    AllowedTokens,
    LogitBias,
    LogitsProcessor,
    Penalties,
    banned_last_tokens,
    build_bad_words,
    build_format_mask,
    build_min_tokens_mask,
)
from inference_service.engine.sampler import SamplingBatch, Selection
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.sequence import SequenceStatus
from inference_service.engine.transfer import to_device

_TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE = range(6)


class SamplingState:
    """Row slots of sampling parameters and history for up to `max_num_rows` rows at once.

    `add_row` takes a free slot and writes it; `remove_row` frees it; `batch` gathers a step's rows
    (by slot, in batch order) into a `SamplingBatch`; `record_sampled` appends a step's sampled
    tokens to the history of the rows that keep one."""

    def __init__(self, max_num_rows: int, vocab_size: int, device: torch.device | str = "cpu"):
        self.max_num_rows, self.vocab_size, self.device = max_num_rows, vocab_size, torch.device(device)
        self._free = list(range(max_num_rows - 1, -1, -1))  # popped from the end: lowest slot first
        r = max_num_rows
        self.params = torch.zeros((r, 6), dtype=torch.float32, device=device)  # [R, 6] columns above
        self.top_k = torch.zeros(r, dtype=torch.int64, device=device)  # [R], 0 = off
        # Host copies of what decides which processors and filters a step runs.
        self._host = np.zeros((r, 6), dtype=np.float64)  # as the Python floats compare
        self._top_k = np.zeros(r, dtype=np.int64)
        self._is_greedy = np.zeros(r, dtype=bool)
        self._has_bias = np.zeros(r, dtype=bool)
        self._has_allowed = np.zeros(r, dtype=bool)
        self._bad_words: list[list[list[int]]] = [[]] * r  # token sequences of each row's bad words
        self._has_history = np.zeros(r, dtype=bool)  # repetition, frequency or presence penalty
        self._min_tokens = np.zeros(r, dtype=np.int64)
        self._num_top_logprobs = np.full(r, -1, dtype=np.int64)  # -1: no logprobs
        self._banned: list[tuple[int, ...]] = [()] * r  # ids masked while short of min_tokens
        self._generators: list[torch.Generator | None] = [None] * r
        self.counts: torch.Tensor | None = None  # [R, V] float32 output token counts
        self.seen: torch.Tensor | None = None  # [R, V] bool prompt tokens
        self.bias: torch.Tensor | None = None  # [R, V] float32
        self.allowed: torch.Tensor | None = None  # [R, V] bool

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def add_row(self, params: SamplingParams, prompt_token_ids: Sequence[int] = (),
                output_token_ids: Sequence[int] = (), generator: torch.Generator | None = None,
                eos_token_ids: Collection[int] = ()) -> int:
        """Writes a row into a free slot and returns the slot. The history is the row's tokens so far
        (read only when it has a penalty); `eos_token_ids` are masked with `stop_token_ids` while it
        has fewer than `min_tokens` outputs, unless `ignore_eos`."""
        if not self._free:
            raise RuntimeError(f"all {self.max_num_rows} sampling rows are in use")
        slot = self._free.pop()
        p = params
        values = [p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
        self._host[slot] = values
        self.params[slot] = to_device(values, torch.float32, self.device)
        self._top_k[slot] = p.top_k
        # NOTE: never a Python scalar into a device tensor: that copies from pageable memory and waits
        # for the stream, i.e. for the forward launched just before (a 4k prefill: ~75 ms of the host).
        self.top_k[slot:slot + 1] = to_device([p.top_k], torch.int64, self.device)
        self._is_greedy[slot] = p.is_greedy
        self._min_tokens[slot] = p.min_tokens
        self._num_top_logprobs[slot] = p.top_logprobs if p.logprobs else -1
        banned = set(p.stop_token_ids) if p.min_tokens else set()
        if p.min_tokens and not p.ignore_eos:
            banned.update(eos_token_ids)
        self._banned[slot] = tuple(sorted(banned))
        self._generators[slot] = generator
        self._write_bias(slot, p.logit_bias)
        self._write_allowed(slot, p.allowed_token_ids)
        self._bad_words[slot] = p.bad_words_token_ids
        self._write_history(slot, p, prompt_token_ids, output_token_ids)
        return slot

    def remove_row(self, slot: int) -> None:
        """Frees a slot; its values stay until the next `add_row` overwrites them."""
        assert slot not in self._free, slot
        self._generators[slot] = None
        self._free.append(slot)

    def _write_bias(self, slot: int, logit_bias: dict[int, float]) -> None:
        self._has_bias[slot] = bool(logit_bias)
        if not logit_bias and self.bias is None:
            return
        if self.bias is None:
            self.bias = torch.zeros((self.max_num_rows, self.vocab_size), dtype=torch.float32, device=self.device)
        row = self.bias[slot]
        row.zero_()
        if logit_bias:
            row[to_device(list(logit_bias), torch.long, self.device)] = to_device(
                list(logit_bias.values()), torch.float32, self.device)

    def _write_allowed(self, slot: int, allowed_token_ids: Sequence[int]) -> None:
        self._has_allowed[slot] = bool(allowed_token_ids)
        if not allowed_token_ids:
            return
        if self.allowed is None:
            self.allowed = torch.zeros((self.max_num_rows, self.vocab_size), dtype=torch.bool, device=self.device)
        row = self.allowed[slot]
        row.zero_()
        row.index_fill_(0, to_device(list(allowed_token_ids), torch.long, self.device), True)

    def _write_history(self, slot: int, p: SamplingParams, prompt_token_ids: Sequence[int],
                       output_token_ids: Sequence[int]) -> None:
        has_repetition = p.repetition_penalty != 1.0
        has_history = has_repetition or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        self._has_history[slot] = has_history
        if not has_history and self.counts is None:
            return
        if self.counts is None:
            shape = (self.max_num_rows, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        if not has_history:
            return
        if output_token_ids:
            ids = to_device(list(output_token_ids), torch.long, self.device)
            self.counts[slot].index_put_((ids,), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        if has_repetition and prompt_token_ids:
            self.seen[slot].index_fill_(0, to_device(list(prompt_token_ids), torch.long, self.device), True)

    def batch(self, slots: Sequence[int], num_output_tokens: Sequence[int],
              grammars: Sequence[Any] | None = None,
              output_token_ids: Sequence[Sequence[int] | None] | None = None) -> SamplingBatch:
        """The step's sampling inputs: batch row i is slot `slots[i]`, which has
        `num_output_tokens[i]` outputs so far (for min_tokens). `grammars[i]` is row i's
        structured-output matcher or None; it must have consumed every earlier token.
        `output_token_ids[i]`: row i's outputs on the host, for its bad words (None for a row without)."""
        n = len(slots)
        slots_np = np.asarray(slots, dtype=np.int64)
        # [N] on the device, uploaded only for a processor or a sampled row: an all-greedy step uploads nothing
        slot_ids = functools.cache(lambda: to_device(slots, torch.long, self.device))
        processors: list[LogitsProcessor] = []
        format_mask = build_format_mask(grammars, self.vocab_size, self.device)
        if format_mask is not None:
            processors.append(format_mask)
        if self._has_allowed[slots_np].any():
            rows, row_slots = self._subset(self._has_allowed[slots_np], slot_ids)
            processors.append(AllowedTokens(rows, self.allowed[row_slots]))
        bad_words = self._bad_words_mask(slots, output_token_ids)
        if bad_words is not None:
            processors.append(bad_words)
        if self._has_bias[slots_np].any():
            rows, row_slots = self._subset(self._has_bias[slots_np], slot_ids)
            processors.append(LogitBias(rows, self.bias[row_slots]))
        min_tokens = self._min_tokens_mask(slots, num_output_tokens)
        if min_tokens is not None:
            processors.append(min_tokens)
        history = None
        if self._has_history[slots_np].any():
            history = self._subset(self._has_history[slots_np], slot_ids)
            processors.append(self._penalties(slots_np, *history))
        logprob_rows = np.flatnonzero(self._num_top_logprobs[slots_np] >= 0).tolist()
        return SamplingBatch(
            num_rows=n, processors=processors, selection=self._selection(slots_np, slot_ids),
            logprob_rows=logprob_rows,
            num_top_logprobs=self._num_top_logprobs[slots_np[logprob_rows]].tolist() if logprob_rows else [],
            history=history,
        )

    def _subset(self, is_row: np.ndarray, slot_ids: Callable[[], torch.Tensor]
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(batch rows [K] or None for every row, their slots [K]) of the rows where `is_row`; `slot_ids()` is
        every row's slot on the device."""
        if is_row.all():
            return None, slot_ids()
        rows = to_device(np.flatnonzero(is_row).tolist(), torch.long, self.device)
        return rows, slot_ids()[rows]

    def _bad_words_mask(self, slots: Sequence[int], output_token_ids: Sequence[Sequence[int] | None] | None):
        rows = [i for i, s in enumerate(slots) if self._bad_words[s]]
        if not rows:
            return None
        banned = [banned_last_tokens(self._bad_words[slots[i]], output_token_ids[i] or ()) for i in rows]
        return build_bad_words(rows, banned, self.device)

    def _min_tokens_mask(self, slots: Sequence[int], num_output_tokens: Sequence[int]):
        short = [(i, s) for i, s in enumerate(slots) if num_output_tokens[i] < self._min_tokens[s] and self._banned[s]]
        if not short:
            return None
        return build_min_tokens_mask([i for i, _ in short], [self._banned[s] for _, s in short], self.device)

    def _penalties(self, slots_np: np.ndarray, rows: torch.Tensor | None, row_slots: torch.Tensor) -> Penalties:
        host = self._host[slots_np[self._has_history[slots_np]]]  # [K, 6]
        params = self.params[row_slots]  # [K, 6]
        counts = self.counts[row_slots]  # [K, V]
        repetition = seen = frequency = presence = None
        if (host[:, _REPETITION] != 1.0).any():
            repetition = params[:, _REPETITION:_REPETITION + 1]
            seen = self.seen[row_slots] | (counts > 0)
        if (host[:, _FREQUENCY] != 0.0).any() or (host[:, _PRESENCE] != 0.0).any():
            frequency, presence = params[:, _FREQUENCY:_FREQUENCY + 1], params[:, _PRESENCE:_PRESENCE + 1]
        return Penalties(rows, repetition, seen, frequency, presence, counts if frequency is not None else None)

    def _selection(self, slots_np: np.ndarray, slot_ids: Callable[[], torch.Tensor]) -> Selection | None:
        """Temperature and filters of the rows drawn at random; None when every row is greedy."""
        is_sampled = ~self._is_greedy[slots_np]
        if not is_sampled.any():
            return None
        rows = np.flatnonzero(is_sampled).tolist()
        row_ids, row_slots = self._subset(is_sampled, slot_ids)
        sampled_slots = slots_np[is_sampled]
        host = self._host[sampled_slots]  # [S, 6]
        params = self.params[row_slots]  # [S, 6]
        max_top_k = int(self._top_k[sampled_slots].max())
        return Selection(
            rows=rows,
            row_ids=row_ids,
            temperature=params[:, _TEMPERATURE:_TEMPERATURE + 1],
            top_k=self.top_k[row_slots] if max_top_k > 0 else None,
            max_top_k=max_top_k,
            top_p=params[:, _TOP_P] if (host[:, _TOP_P] < 1.0).any() else None,
            min_p=params[:, _MIN_P] if (host[:, _MIN_P] > 0.0).any() else None,
            generators=[self._generators[s] for s in sampled_slots.tolist()],
        )

    def record_sampled(self, batch: SamplingBatch, token_ids: torch.Tensor) -> None:
        """Adds the step's sampled tokens [N] to the history of its rows that keep one, on the
        device (queued after the sampling; nothing waits)."""
        if batch.history is None:
            return
        rows, row_slots = batch.history
        ids = token_ids if rows is None else token_ids[rows]  # [K]
        self.counts.index_put_((row_slots, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)


class SamplingRows:
    """Which slot of a `SamplingState` each running sequence holds.

    A sequence gets its row at its first sampling step (written from its tokens so far, which are
    all on the host then) and keeps it while it runs; the rows of sequences that stopped running
    (finished, aborted or preempted) are freed at the next `update`. A preempted sequence is
    readmitted only once its last token is on the host, so its new row starts from its full history."""

    def __init__(self, state: SamplingState):
        self.state = state
        self._held: dict[int, tuple[Any, int]] = {}  # seq_id -> (sequence, slot)

    def update(self, seqs: Sequence[Any]) -> None:
        """Frees the rows of sequences no longer running; adds rows for `seqs` that have none."""
        held = self._held
        stopped = [seq_id for seq_id, (seq, _) in held.items() if seq.status is not SequenceStatus.RUNNING]
        for seq_id in stopped:
            self.state.remove_row(held.pop(seq_id)[1])
        for seq in seqs:
            if seq.seq_id not in held:
                slot = self.state.add_row(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator,
                                          seq.eos_token_ids)
                held[seq.seq_id] = (seq, slot)

    def slots(self, seqs: Sequence[Any]) -> list[int]:
        held = self._held
        return [held[seq.seq_id][1] for seq in seqs]
