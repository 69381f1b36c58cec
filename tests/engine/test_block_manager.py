"""Block manager: exact block ids, ref counts, prefix hits and LRU eviction."""

from inference_service.engine.block_manager import NO_HASH, BlockManager
from inference_service.engine.sampling_params import SamplingParams
from inference_service.engine.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, 0, list(tokens), len(tokens), SamplingParams(), frozenset({2}), 10_000)


def ref_counts(bm: BlockManager) -> dict[int, int]:
    return {b.block_id: b.ref_count for b in bm.blocks if b.ref_count}


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Allocates the whole uncomputed part and marks it computed, as a one-step prefill would."""
    assert bm.allocate_slots(seq, seq.num_uncomputed_tokens)
    bm.commit_full_blocks(seq, len(seq.token_ids))
    seq.num_computed_tokens = len(seq.token_ids)


def test_allocation_takes_lowest_free_ids_in_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(10)))  # 3 blocks: 4 + 4 + 2
    prefill(bm, a)
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    assert ref_counts(bm) == {0: 1, 1: 1, 2: 1}
    assert a.num_cached_tokens == 0


def test_identical_prefix_shares_full_blocks_and_counts_cached_tokens():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(10)), "a")
    prefill(bm, a)
    b = make_seq(list(range(8)) + [99, 98, 97], "b")  # shares blocks 0 and 1 (8 tokens)
    assert bm.allocate_slots(b, b.num_uncomputed_tokens)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert ref_counts(bm) == {0: 2, 1: 2, 2: 1, 3: 1}
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (10 + 11, 8)


def test_last_prompt_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(8)), "a")  # exactly two full blocks
    prefill(bm, a)
    b = make_seq(list(range(8)), "b")
    assert bm.allocate_slots(b, 8)
    # Only the first block is a hit; the block holding the last token is recomputed.
    assert b.block_table == [0, 2]
    assert b.num_computed_tokens == 4
    assert b.num_uncomputed_tokens == 4


def test_different_earlier_block_prevents_later_hits():
    bm = BlockManager(num_blocks=8, block_size=BS)
    prefill(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    b = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], "b")  # block 1's tokens equal but its prefix differs
    assert bm.allocate_slots(b, 9)
    assert b.num_computed_tokens == 0
    assert b.block_table == [3, 4, 5]


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(9)), "a")  # blocks 0, 1 full + 2 partial
    prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and ref_counts(bm) == {}
    # Freed in reverse: the tail block 2 is evicted first, then 1, then 0.
    assert list(bm.free_block_ids) == [3, 2, 1, 0]
    b = make_seq(list(range(8)) + [50], "b")
    assert bm.allocate_slots(b, 9)
    assert b.block_table == [0, 1, 3]  # revived 0 and 1 from the free list, new block 3
    assert b.num_cached_tokens == 8
    assert list(bm.free_block_ids) == [2]
    c = make_seq([7] * 5, "c")  # needs 2 blocks, only 1 free
    assert not bm.allocate_slots(c, 5)
    assert c.block_table == [] and bm.num_free_blocks == 1


def test_eviction_removes_hash():
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = make_seq(list(range(5)), "a")
    prefill(bm, a)
    h = bm.blocks[0].hash
    assert h != NO_HASH and bm.hash_to_block_id[h] == 0
    bm.free(a)
    b = make_seq([9] * 8, "b")  # takes both blocks, evicting block 0's contents
    prefill(bm, b)
    assert h not in bm.hash_to_block_id
    c = make_seq(list(range(5)), "c")
    assert bm.find_cached_prefix(c.token_ids) == []


def test_decode_appends_a_block_only_at_boundary():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq([1, 2, 3], "a")
    prefill(bm, a)
    assert a.block_table == [0]
    a.append_token(4)  # 4 tokens; computing token 4 still fits block 0
    assert bm.allocate_slots(a, 1) and a.block_table == [0]
    a.num_computed_tokens += 1
    a.append_token(5)
    assert bm.allocate_slots(a, 1) and a.block_table == [0, 1]


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    prefill(bm, make_seq(list(range(9)), "a"))
    b = make_seq(list(range(9)), "b")
    prefill(bm, b)
    assert b.block_table == [3, 4, 5] and b.num_cached_tokens == 0
