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

    Built by its constructors: `from_step` (device tensors already filled, e.g. the engine's persistent
    buffers), `for_sequences` (a step described by host lists: tests, benches, the embedding pass,
    memory profiling) and `for_decode_capture` (padding rows a CUDA graph is captured over).
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

    @classmethod
    def from_step(cls, *, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, query_start_loc_cpu: list[int], seq_lens_cpu: list[int],
                  max_seq_len: int | None = None) -> AttentionMetadata:
        """Metadata over tensors already on the device and their host copies; `max_query_len` and
        `num_decode_seqs` are read off `query_start_loc_cpu`, `max_seq_len` defaults to the longest of
        `seq_lens_cpu`."""
        query_lens = [end - start for start, end in zip(query_start_loc_cpu, query_start_loc_cpu[1:])]
        num_decode_seqs = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        return cls(slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
                   block_tables=block_tables, max_query_len=max(query_lens, default=0),
                   max_seq_len=max(seq_lens_cpu, default=0) if max_seq_len is None else max_seq_len,
                   query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu,
                   num_decode_seqs=num_decode_seqs)

    @classmethod
    def for_sequences(cls, num_cached: list[int], query_lens: list[int], block_tables: list[list[int]],
                      block_size: int, device: torch.device | str | None = None, *,
                      write_kv: bool = True) -> AttentionMetadata:
        """A step where sequence i adds `query_lens[i]` tokens after `num_cached[i]` cached ones, its
        blocks `block_tables[i]` (rows padded with block 0). `write_kv=False` marks every slot -1:
        nothing is written to the cache (memory profiling)."""
        slots, starts, seq_lens = [], [0], []
        for before, query_len, table in zip(num_cached, query_lens, block_tables, strict=True):
            slots.extend(table[pos // block_size] * block_size + pos % block_size
                         for pos in range(before, before + query_len))
            starts.append(starts[-1] + query_len)
            seq_lens.append(before + query_len)
        if not write_kv:
            slots = [-1] * len(slots)
        width = max(len(t) for t in block_tables)
        tables = [t + [0] * (width - len(t)) for t in block_tables]
        return cls.from_step(slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                             block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
                             query_start_loc_cpu=starts, seq_lens_cpu=seq_lens)

    @classmethod
    def for_decode_capture(cls, *, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> AttentionMetadata:
        """`len(seq_lens)` one-token sequences over the given (persistent) tensors, as a CUDA graph is
        captured: the host side claims every sequence may reach `max_seq_len`, so kernel choices made
        from it (the decode split count) suit every later replay."""
        num_seqs = seq_lens.shape[0]
        return cls.from_step(slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
                             block_tables=block_tables, query_start_loc_cpu=list(range(num_seqs + 1)),
                             seq_lens_cpu=[max_seq_len] * num_seqs)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
