"""Paged attention on the Triton kernels of `kernels/`: the GPU backend.

One layer's step is two or three launches::

    write_kv_cache(k, v -> cache at slot_mapping)           # slot -1 (padding) skipped
    decode-only step  -> paged_decode_attention             # one query per sequence, split-KV
    anything else     -> paged_prefill_attention            # prefill, chunked prefill, prefix hits, mixed

The prefill kernel reads every key and value from the cache, new ones included, so the write comes
first. Neither launch needs a host sync: the decode split count comes from the step's host-side
`max_seq_len` and the prefill grid from `max_query_len`, both already in `AttentionMetadata`.

`kernels` (and so Triton) is imported when the backend is built, never by the CPU path.
"""

from __future__ import annotations

import torch

from inference_service.attention.metadata import AttentionMetadata


class TritonPagedAttention:
    """`AttentionBackend` on the Triton kernels (CUDA, or the Triton interpreter on CPU for tests).

    `k_scale` / `v_scale` are the per-layer dequantization scales of an fp8 (e4m3) cache; with a
    cache in the activation dtype they stay 1.0."""

    name = "triton"

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        import kernels  # noqa: PLC0415 - Triton only where this backend is chosen

        self._kernels = kernels
        self.k_scale, self.v_scale = k_scale, v_scale
        # Split count of the last decode step, reused while the step's metadata object is the same
        # (every layer of one step), so it is computed once a step.
        self._splits_for: tuple[int, int] | None = None
        self._splits = 1

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        kern = self._kernels
        kern.write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale=self.k_scale,
                            v_scale=self.v_scale)
        if metadata.is_decode_only and q.shape[0] == metadata.num_seqs:
            return kern.paged_decode_attention(
                q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale,
                num_kv_splits=self._num_kv_splits(metadata, k_cache),
                k_scale=self.k_scale, v_scale=self.v_scale,
            )  # [T, Hq, D]
        # NOTE: a mixed batch spends one block_m-row program per decode row here; splitting decode rows
        # off to the decode kernel is a later optimisation (kernels/README.md, "Open").
        return kern.paged_prefill_attention(
            q, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
            metadata.max_query_len, scale, k_scale=self.k_scale, v_scale=self.v_scale,
        )  # [T, Hq, D]; rows past query_start_loc[-1] unwritten

    def _num_kv_splits(self, metadata: AttentionMetadata, k_cache: torch.Tensor) -> int:
        key = (metadata.num_seqs, metadata.max_seq_len)
        if key != self._splits_for:
            self._splits = self._kernels.choose_num_kv_splits(
                metadata.num_seqs, k_cache.shape[2], metadata.max_seq_len, k_cache.device)
            self._splits_for = key
        return self._splits
