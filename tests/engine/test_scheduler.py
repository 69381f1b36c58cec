"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption and resumption."""

from inference_service.config import SchedulerConfig
from inference_service.engine.block_manager import BlockManager
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.scheduler import Scheduler
from inference_service.engine.sequence import FinishReason, Sequence, SequenceStatus

BS = 4
EOS = 2


def make_seq(num_prompt: int, request_id: str, max_tokens: int = 100, first_token: int = 10) -> Sequence:
    tokens = list(range(first_token, first_token + num_prompt))
    return Sequence(request_id, 0, tokens, num_prompt, SamplingParams(max_tokens=max_tokens), frozenset({EOS}),
                    num_prompt + max_tokens)


def make_scheduler(num_blocks=16, **kwargs) -> Scheduler:
    cfg = SchedulerConfig(**{"max_num_seqs": 4, "max_num_batched_tokens": 16, "max_prefill_chunk": 16, **kwargs})
    return Scheduler(cfg, BlockManager(num_blocks, BS))


def step(sched: Scheduler, token: int = 7):
    """One schedule + update, sampling `token` for every sequence that samples."""
    out = sched.schedule()
    sampled = {s.seq.seq_id: token for s in out.scheduled if s.is_sampling}
    sched.update_from_output(out, sampled)
    return out


def plan(out) -> list[tuple[str, int, bool]]:
    return [(s.seq.request_id, s.num_new_tokens, s.is_sampling) for s in out.scheduled]


def test_decode_mixes_with_chunked_prefill_under_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8, max_prefill_chunk=8)
    a, b = make_seq(5, "a", first_token=100), make_seq(11, "b", first_token=200)
    sched.add(a)
    sched.add(b)
    # a prefills fully (5) and b gets the 3 tokens left in the budget.
    assert plan(step(sched)) == [("a", 5, True), ("b", 3, False)]
    assert a.num_output_tokens == 1 and b.num_computed_tokens == 3
    # a decodes one token; b continues its prefill with the remaining budget.
    assert plan(step(sched)) == [("a", 1, True), ("b", 7, False)]
    assert plan(step(sched)) == [("a", 1, True), ("b", 1, True)]
    assert b.num_output_tokens == 1 and a.num_output_tokens == 3


def test_prefill_chunk_caps_one_sequence():
    sched = make_scheduler(max_num_batched_tokens=16, max_prefill_chunk=6)
    a = make_seq(14, "a")
    sched.add(a)
    assert [plan(step(sched)) for _ in range(3)] == [[("a", 6, False)], [("a", 6, False)], [("a", 2, True)]]


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(2, f"r{i}") for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert [r for r, _, _ in plan(step(sched))] == ["r0", "r1"]
    assert seqs[2].status == SequenceStatus.WAITING
    sched.finish(seqs[0], FinishReason.ABORT)
    assert [r for r, _, _ in plan(step(sched))] == ["r1", "r2"]


def test_preemption_by_recompute_and_resumption():
    # 4 blocks of 4 tokens; two sequences of 6-token prompts use 2 blocks each.
    sched = make_scheduler(num_blocks=4)
    a, b = make_seq(6, "a", first_token=100), make_seq(6, "b", first_token=200)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: tokens 0..5 computed, token 6 sampled
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    step(sched)  # token 6 computed (still in block 1 / 3), token 7 sampled
    step(sched)  # token 7 computed (last slot of block 1 / 3), token 8 sampled
    # Computing token 8 needs a third block each; none is free: b (newest) is preempted.
    out = step(sched)
    assert [s.request_id for s in out.preempted] == ["b"]
    assert plan(out) == [("a", 1, True)]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    assert list(sched.waiting) == [b]
    # b's freed blocks went back to the cache; a took one of them for its third block.
    assert a.block_table == [0, 1, 3]
    sched.finish(a, FinishReason.STOP)
    # b resumes: its first block (prompt tokens 200..203) is still cached; the rest is recomputed
    # over prompt + output so far.
    out = step(sched)
    assert plan(out) == [("b", 5, True)]
    assert b.num_output_tokens == 4 and b.num_cached_tokens == 0  # usage counts the first admission
    sched.finish(b, FinishReason.STOP)
    assert sched.block_manager.num_free_blocks == 4


def test_all_blocks_free_when_idle():
    sched = make_scheduler(num_blocks=16)
    seqs = [make_seq(3 + i, f"r{i}", max_tokens=3 + i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    while sched.num_unfinished:
        step(sched)
    assert all(s.finish_reason == FinishReason.LENGTH for s in seqs)
    assert [s.num_output_tokens for s in seqs] == [3, 4, 5, 6]
    bm = sched.block_manager
    assert bm.num_free_blocks == 16 and all(b.ref_count == 0 for b in bm.blocks)


def test_eos_finishes_and_frees():
    sched = make_scheduler()
    a = make_seq(3, "a")
    sched.add(a)
    step(sched, token=EOS)
    assert a.is_finished and a.finish_reason == FinishReason.STOP
    assert a.output_token_ids == [EOS]
    assert sched.block_manager.num_free_blocks == 16


def sampled_by(out, token: int) -> dict[int, int]:
    return {s.seq.seq_id: token for s in out.scheduled if s.is_sampling}


def test_async_schedules_the_pending_token_before_its_id_is_known():
    sched = make_scheduler()
    a = make_seq(3, "a", max_tokens=10)
    sched.add(a)
    first = sched.schedule()  # prefill: samples token 3
    assert (a.num_computed_tokens, a.num_pending_tokens) == (3, 1)
    second = sched.schedule()  # computes the pending token 3 before it reached the host
    assert [(s.start, s.num_new_tokens, s.is_sampling) for s in second.scheduled] == [(3, 1, True)]
    assert (len(a.token_ids), a.num_computed_tokens, a.num_pending_tokens) == (3, 4, 2)
    sched.update_from_output(first, sampled_by(first, 50))
    sched.update_from_output(second, sampled_by(second, 51))
    assert a.output_token_ids == [50, 51] and a.num_pending_tokens == 0


def test_async_hashes_a_block_once_its_pending_token_is_known():
    sched = make_scheduler()
    a = make_seq(3, "a", max_tokens=10)  # token 3 (sampled by the prefill) fills block 0
    sched.add(a)
    first = sched.schedule()
    second = sched.schedule()  # computes token 3: block 0 is full but one of its ids is unknown
    block = sched.block_manager.blocks[a.block_table[0]]
    assert a.num_hashed_blocks == 0 and block.token_ids == ()
    sched.update_from_output(first, sampled_by(first, 50))
    third = sched.schedule()
    assert a.num_hashed_blocks == 1 and block.token_ids == (10, 11, 12, 50)
    sched.update_from_output(second, sampled_by(second, 51))
    sched.update_from_output(third, sampled_by(third, 52))


def test_async_does_not_schedule_a_sequence_its_pending_token_ends():
    sched = make_scheduler()
    a, b = make_seq(3, "a", max_tokens=2), make_seq(3, "b", max_tokens=5)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    second = sched.schedule()
    sched.update_from_output(first, sampled_by(first, 7))
    third = sched.schedule()  # a's pending token is its last: only b runs
    assert plan(third) == [("b", 1, True)]
    sched.update_from_output(second, sampled_by(second, 7))
    assert a.finish_reason == FinishReason.LENGTH and a.output_token_ids == [7, 7]
    sched.update_from_output(third, sampled_by(third, 8))
    assert b.output_token_ids == [7, 7, 8]


def test_async_eos_drops_the_token_computed_after_it():
    sched = make_scheduler()
    a = make_seq(3, "a")
    sched.add(a)
    first = sched.schedule()
    second = sched.schedule()
    sched.update_from_output(first, sampled_by(first, EOS))
    assert a.is_finished and sched.block_manager.num_free_blocks == 16
    assert sched.update_from_output(second, sampled_by(second, 9)) == []
    assert a.output_token_ids == [EOS]


def test_async_preempted_sequence_gets_its_pending_token_then_resumes():
    sched = make_scheduler(num_blocks=4)
    a, b = make_seq(6, "a", first_token=100), make_seq(6, "b", first_token=200)
    sched.add(a)
    sched.add(b)
    outs = [sched.schedule(), sched.schedule()]  # prefill (samples token 6), token 6 computed
    sched.update_from_output(outs[0], sampled_by(outs[0], 60))
    outs.append(sched.schedule())  # token 7 computed (last slot of block 1 / 3)
    sched.update_from_output(outs[1], sampled_by(outs[1], 61))
    out = sched.schedule()  # token 8 needs a third block each: b is preempted with token 8 pending
    assert [s.request_id for s in out.preempted] == ["b"] and plan(out) == [("a", 1, True)]
    assert b.num_pending_tokens == 1 and b.block_table == [] and b.num_computed_tokens == 0
    sched.update_from_output(outs[2], sampled_by(outs[2], 62))
    sched.update_from_output(out, sampled_by(out, 63))
    assert b.output_token_ids == [60, 61, 62] and b.num_pending_tokens == 0
    assert a.output_token_ids == [60, 61, 62, 63]
    sched.finish(a, FinishReason.STOP)
    resumed = sched.schedule()  # block 0 (prompt only) is cached; block 1 was never hashed
    assert [(s.start, s.num_new_tokens) for s in resumed.scheduled] == [(4, 5)]
