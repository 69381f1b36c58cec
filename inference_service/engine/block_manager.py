"""Paged KV-cache blocks: allocation, reference counts and hash-based prefix caching."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from inference_service.engine.sequence import Sequence

NO_HASH = -1


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH  # chained hash of all tokens up to the end of this block; NO_HASH if not full
    token_ids: tuple[int, ...] = field(default_factory=tuple)  # this block's tokens, to rule out collisions


def chain_hash(prefix_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of everything before it: equal prefixes, equal hashes."""
    return hash((prefix_hash, token_ids))


class BlockManager:
    """Hands out fixed-size KV blocks to sequences and shares full blocks of identical prefixes.

    A full block is identified by the chained hash of every token up to its end, so two prompts
    share block i only if they agree on all tokens of blocks 0..i. Freed blocks keep their hash and
    stay findable until reused; the free list is LRU (a freed block goes to the back, allocation
    takes from the front), so recently used prefixes survive longest.

        seq A: [b3 full h1][b7 full h2][b9 partial]
        seq B: [b3 full h1][b7 full h2][b12 partial]   <- b3, b7 ref_count 2
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by running sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix of `token_ids` (full blocks only).

        The last token is never served from cache: its logits must be computed to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        hit_ids: list[int] = []
        prefix_hash = NO_HASH
        num_full = (len(token_ids) - 1) // self.block_size
        for i in range(num_full):
            chunk = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            prefix_hash = chain_hash(prefix_hash, chunk)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hit_ids.append(block_id)
        return hit_ids

    # ---- allocation ---------------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Makes `seq.block_table` cover its computed tokens plus `num_new_tokens`.

        On first allocation the longest cached prefix is reused and counted into
        `seq.num_computed_tokens`. Returns False, changing nothing, if there are not enough free
        blocks (the caller then preempts).
        """
        if not seq.block_table and seq.num_computed_tokens == 0:
            return self._allocate_first(seq, num_new_tokens)
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())
        return True

    def _allocate_first(self, seq: Sequence, num_new_tokens: int) -> bool:
        hit_ids = self.find_cached_prefix(seq.token_ids)
        if seq.is_collecting_prompt_logprobs:
            # NOTE: a cached position has no logits: recompute from the first one still without logprobs.
            hit_ids = hit_ids[: seq.num_prompt_logprobs_scheduled // self.block_size]
        num_hit_tokens = len(hit_ids) * self.block_size
        num_new_tokens = min(num_new_tokens, len(seq.token_ids) - num_hit_tokens)
        num_new_blocks = self.blocks_needed(num_hit_tokens + num_new_tokens) - len(hit_ids)
        # Hit blocks with ref_count 0 sit in the free list: taking them costs free blocks too.
        num_revived = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_revived > self.num_free_blocks:
            return False
        for block_id in hit_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
        seq.block_table = hit_ids + [self._take_free_block() for _ in range(num_new_blocks)]
        seq.num_computed_tokens = num_hit_tokens
        seq.num_hashed_blocks = len(hit_ids)
        if seq.num_cached_tokens < 0:  # usage reports what the first admission found
            seq.num_cached_tokens = num_hit_tokens
            self.num_prefix_queries += seq.num_prompt_tokens
            self.num_prefix_hits += num_hit_tokens
        return True

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH:  # evict its cached contents
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = NO_HASH, ()
        block.ref_count = 1
        return block_id

    def commit_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Registers the hashes of the blocks that `num_computed_tokens` fills.

        Called when a step is scheduled: the backend writes every new K/V of a step before any
        attention reads, so a block is safe to share from the step that computes it.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens, len(seq.token_ids)) // bs
        start = seq.num_hashed_blocks
        prefix_hash = self.blocks[seq.block_table[start - 1]].hash if start else NO_HASH
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH:
                chunk = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                block.hash, block.token_ids = chain_hash(prefix_hash, chunk), chunk
                self.hash_to_block_id.setdefault(block.hash, block.block_id)
            prefix_hash = block.hash
        seq.num_hashed_blocks = max(start, num_full)

    def free(self, seq: Sequence) -> None:
        """Releases the sequence's blocks; tail blocks go first so shared prefixes live longest."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
