"""Continuous batching: which sequences run in the next step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from inference_service.config import SchedulerConfig
from inference_service.engine.block_manager import BlockManager
from inference_service.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token computed in the step (num_computed_tokens before it)
    num_new_tokens: int  # tokens computed for this sequence in the step
    is_sampling: bool  # the step computes its last token, so it samples the next one


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """Order of the priority policy: lowest priority value, then earliest arrival, then creation."""
    return seq.priority, seq.arrival_time, seq.seq_id


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Builds each step under a token budget: running sequences first (one token each when
    decoding, a chunk when still prefilling), then waiting sequences in arrival order.

    When blocks run out, the most recently arrived running sequence is preempted by recompute:
    its blocks are freed (they stay in the prefix cache) and it goes back to the front of the
    waiting queue, to be prefilled again over its prompt and output so far.

    Under the "priority" policy both queues are kept in `priority_key` order instead (lowest
    priority value first, then arrival): the waiting queue is admitted in that order and the
    running sequence last in it is the one preempted.

    Scheduling a step advances `num_computed_tokens` and counts the token a sampling sequence
    will get as pending, so the next step can be scheduled before this one's ids are known
    (async scheduling); `update_from_output` appends them. Invariant: at most one step's tokens
    are pending at a schedule, and a sequence preempted with a pending token is not readmitted
    before its update (no admission follows a preemption in the same schedule).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def is_priority(self) -> bool:
        return self.config.policy == "priority"

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.is_priority:
            self._insert_waiting(seq)
        else:
            self.waiting.append(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        """Inserts into the waiting queue kept in `priority_key` order (after its equals)."""
        key = priority_key(seq)
        i = len(self.waiting)
        while i > 0 and priority_key(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk = self.config.max_prefill_chunk

        # Running sequences, oldest (priority: most urgent) first; victims of preemption come from the back.
        if self.is_priority:
            self.running.sort(key=priority_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if len(seq.token_ids) + seq.num_pending_tokens >= seq.max_total_tokens:
                i += 1  # its pending token ends it (length): nothing left to compute
                continue
            num_new = min(seq.num_uncomputed_tokens, budget, chunk)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._add_scheduled(out, seq, num_new)
                budget -= num_new
                i += 1

        # Waiting sequences, first come first served; none after a preemption this step.
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget, chunk)
            if not self.block_manager.allocate_slots(seq, num_new):
                break
            self.waiting.popleft()
            num_new = min(num_new, seq.num_uncomputed_tokens)  # prefix hits shrink the work
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_scheduled(out, seq, num_new)
            budget -= num_new
        return out

    def _add_scheduled(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        start = seq.num_computed_tokens
        seq.num_computed_tokens = start + num_new
        # Blocks holding a pending token are hashed at a later step, once its id is known.
        self.block_manager.commit_full_blocks(seq, seq.num_computed_tokens)
        is_sampling = seq.num_uncomputed_tokens == 0
        if is_sampling:
            seq.num_pending_tokens += 1
        out.scheduled.append(ScheduledSeq(seq, start, num_new, is_sampling))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.is_priority:
            self._insert_waiting(seq)
        else:
            self.waiting.appendleft(seq)

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids: dict[int, int]) -> list[Sequence]:
        """Appends the step's sampled tokens to their sequences and ends those a token stop rule ends.

        `sampled_token_ids` maps `seq_id` to the token id sampled for it. Returns the sequences that
        received a token (finished ones included, with their finish reason set and blocks freed); a
        sequence preempted since the step was scheduled gets its token too.
        """
        advanced: list[Sequence] = []
        for s in out.scheduled:
            seq = s.seq
            if not s.is_sampling or seq.is_finished:  # finished: aborted or stopped while the step ran
                continue
            seq.num_pending_tokens -= 1
            seq.append_token(sampled_token_ids[seq.seq_id])
            advanced.append(seq)
            verdict = seq.check_stop()
            if verdict is not None:
                self.finish(seq, verdict.reason, verdict.stop_reason)
        return advanced

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Ends a sequence: frees its blocks, drops it from the queues and records why.

        The one writer of a sequence's finish state. Called again on a sequence that ended by a token
        rule in the same update, it replaces the reason: a stop string found in the text released at
        the end is what the client sees (see `OutputProcessor.process`)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.status != SequenceStatus.FINISHED:
            self.block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
