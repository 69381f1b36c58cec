"""Prompt logprobs (vLLM's `prompt_logprobs`): the logprob, rank and top alternatives of every prompt
token after the first, from the logits at the position before it.

A prefill chunk computes the hidden states of its positions; position p's logits score prompt token
p + 1. The last prompt position scores the first output token, which the sampler handles::

    prompt:     t0   t1   t2   t3   t4
    position:   0    1    2    3    4
    scores:     t1   t2   t3   t4   (sampled)
    chunk 1:  [ 0    1    2 ]            -> logprobs of t1 t2 t3
    chunk 2:                [ 3    4 ]   -> logprobs of t4

A sequence counts the positions a launched step computes (`num_prompt_logprobs_scheduled`): a
recompute after preemption skips them, and its first admission takes no prefix-cache hit past them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_service.engine.request import TokenLogprob
from inference_service.engine.scheduler import ScheduledSeq
from inference_service.engine.transfer import HostCopy, to_device

# Rows per log_softmax: bounds the float32 [rows, vocab] temporaries of a long prefill chunk.
_ROWS_PER_CHUNK = 256


@dataclass(slots=True)
class PromptLogprobRows:
    """Which rows of a step's hidden states score which prompt tokens."""

    seq_ids: list[int]  # one per sequence with positions in the step
    num_positions: list[int]  # per entry of `seq_ids`: how many consecutive rows are its
    num_top: list[int]  # per entry of `seq_ids`: its `prompt_logprobs`
    hidden_rows: list[int]  # rows of the step's hidden states [R], sequence by sequence
    target_ids: list[int]  # the prompt token each row scores [R]


def select_rows(scheduled: list[ScheduledSeq], query_start_loc: list[int]) -> PromptLogprobRows | None:
    """The step's rows whose logits score prompt tokens still without logprobs (None: no such row).

    Marks them as scheduled on their sequences. `query_start_loc[i]` is the first hidden row of
    `scheduled[i]`."""
    rows = PromptLogprobRows([], [], [], [], [])
    for i, s in enumerate(scheduled):
        seq = s.seq
        if not seq.is_collecting_prompt_logprobs:
            continue
        lo = max(s.start, seq.num_prompt_logprobs_scheduled)
        hi = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
        if hi <= lo:
            continue
        assert lo == seq.num_prompt_logprobs_scheduled, "prompt positions must be computed in order"
        first = query_start_loc[i] - s.start
        rows.seq_ids.append(seq.seq_id)
        rows.num_positions.append(hi - lo)
        rows.num_top.append(seq.params.prompt_logprobs)
        rows.hidden_rows += range(first + lo, first + hi)
        rows.target_ids += seq.token_ids[lo + 1 : hi + 1]
        seq.num_prompt_logprobs_scheduled = hi
    return rows if rows.seq_ids else None


class PendingPromptLogprobs:
    """A step's prompt logprobs as device tensors, on their way to the host."""

    def __init__(self, rows: PromptLogprobRows, chosen: torch.Tensor, ranks: torch.Tensor,
                 top_values: torch.Tensor | None, top_ids: torch.Tensor | None):
        self._rows = rows
        # chosen [R] float32, ranks [R] int64, top values and ids [R, K]
        self._copy = HostCopy([chosen, ranks, top_values, top_ids])

    def result(self) -> dict[int, list[TokenLogprob]]:
        """Waits for the copies; returns each sequence's new entries (by `seq_id`), in prompt order."""
        chosen, ranks, top_values, top_ids = self._copy.wait()
        rows, out, r = self._rows, {}, 0
        for seq_id, num, k in zip(rows.seq_ids, rows.num_positions, rows.num_top):
            out[seq_id] = [
                TokenLogprob(rows.target_ids[j], chosen[j],
                             list(zip(top_ids[j][:k], top_values[j][:k])) if k else [], ranks[j])
                for j in range(r, r + num)
            ]
            r += num
        return out


def compute(model: torch.nn.Module, hidden: torch.Tensor, rows: PromptLogprobRows) -> PendingPromptLogprobs:
    """Queues the logprobs of `rows` from the step's hidden states [T, hidden]: float32 log_softmax of the
    model's logits, the target's value and rank, and the top alternatives."""
    device = hidden.device
    hidden_rows = to_device(rows.hidden_rows, torch.long, device)
    targets = to_device(rows.target_ids, torch.long, device)
    max_top = max(rows.num_top)
    chosen, ranks, top_values, top_ids = [], [], [], []
    for begin in range(0, len(rows.hidden_rows), _ROWS_PER_CHUNK):
        end = begin + _ROWS_PER_CHUNK
        log_probs = model.compute_logits(hidden[hidden_rows[begin:end]]).float().log_softmax(dim=-1)  # [r, V]
        target = log_probs.gather(1, targets[begin:end].unsqueeze(1))  # [r, 1]
        chosen.append(target.squeeze(1))
        ranks.append((log_probs > target).sum(dim=1) + 1)  # vLLM's rank: 1 = the most likely
        if max_top:
            values, ids = log_probs.topk(min(max_top, log_probs.shape[1]), dim=-1)  # most likely first
            top_values.append(values)
            top_ids.append(ids)
    return PendingPromptLogprobs(rows, torch.cat(chosen), torch.cat(ranks),
                                 torch.cat(top_values) if max_top else None,
                                 torch.cat(top_ids) if max_top else None)
