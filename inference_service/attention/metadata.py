"""The batch description every attention backend reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one model step over a flattened batch of sequences.

    The step's tokens are the concatenation of each sequence's new tokens (a prefill chunk or one
    decode token). Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`; those
    queries sit at the end of its context of `seq_lens[i]` tokens, of which
    `seq_lens[i] - query_len` were already in the cache before this step::

        context of seq i:  [ cached (num_computed) ............ | new (query_len) ]
                           0                            seq_len - query_len      seq_len

    KV cache layout per layer: `k_cache`, `v_cache` each [num_blocks, block_size, num_kv_heads, head_dim].
    Token t of sequence i lives in block `block_tables[i, t // block_size]` at offset
    `t % block_size`; `slot_mapping` gives, for each new token, `block * block_size + offset`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, not written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, so the CPU backend can loop without device syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # How many sequences at the front of the batch have one query token each (decodes, or a
    # prompt's last token): a mixed step can run them through a decode kernel. 0 = not counted.
    num_decode_seqs: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
