"""Paged attention on the Triton kernels of `kernels/`: the GPU backend.

One layer's step is one to three launches::

    decode-only step, q and k not yet rotated (`forward_unrotated`)
                      -> paged_decode_attention(append=...)  # rotary, KV write and attention in one
    write_kv_cache(k, v -> cache at slot_mapping)           # slot -1 (padding) skipped
    decode-only step  -> paged_decode_attention             # one query per sequence, split-KV
    anything else     -> paged_decode_attention             # the leading one-token rows, if any
                         paged_prefill_attention            # the rest: prefills, chunks, prefix hits
                      or torch SDPA per prompt              # the rest are whole fresh prompts (dense_prefill.py)

The prefill kernel reads every key and value from the cache, new ones included, so the write comes
first. Neither launch needs a host sync: the decode split count comes from the step's host-side
`max_seq_len` and the prefill grid from `max_query_len`, both already in `AttentionMetadata`.

`kernels` (and so Triton) is imported when the backend is built, never by the CPU path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from inference_service.attention.dense_prefill import dense_prefill_attention, fresh_prefill_spans
from inference_service.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from kernels.rotary import Rotary


class TritonPagedAttention:
    """`AttentionBackend` on the Triton kernels (CUDA, or the Triton interpreter on CPU for tests).

    `k_scale` / `v_scale` are the per-layer dequantization scales of an fp8 (e4m3) cache; with a
    cache in the activation dtype they stay 1.0."""

    name = "triton"

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0, dense_prefill: bool | None = None) -> None:
        import kernels  # noqa: PLC0415 - Triton only where this backend is chosen

        self._kernels = kernels
        self.k_scale, self.v_scale = k_scale, v_scale
        # Fresh prompts through torch's fused SDPA (dense_prefill.py); None: on CUDA only, where it measured faster
        self.dense_prefill = dense_prefill
        # Split count of the last decode launch, by (sequences, longest context): every layer of a
        # step asks the same, so it is computed once a step.
        self._splits_for: tuple[int, int] | None = None
        self._splits = 1
        # Set inside `compiling_every_variant`: each eager decode launch runs at every one of these instead.
        self._every_variant: list | None = None  # [kernels.DecodeLaunch]

    @contextlib.contextmanager
    def compiling_every_variant(self, q_dtype: torch.dtype, k_cache: torch.Tensor) -> Iterator[None]:
        """Within it, a step outside the CUDA graphs launches its decode attention at every compiled variant
        it could take (`kernels.decode_launch_variants`), so that one forward before serving compiles them."""
        self._every_variant = self._kernels.decode_launch_variants(q_dtype, k_cache)
        try:
            yield
        finally:
            self._every_variant = None

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        kern = self._kernels
        kern.write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale=self.k_scale,
                            v_scale=self.v_scale)
        if metadata.is_decode_only and q.shape[0] == metadata.num_seqs:
            return kern.paged_decode_attention(
                q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale,
                num_kv_splits=self._num_kv_splits(metadata.num_seqs, metadata.max_seq_len, k_cache),
                k_scale=self.k_scale, v_scale=self.v_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            )  # [T, Hq, D]
        num_decodes = metadata.num_decode_seqs
        is_dense = q.is_cuda if self.dense_prefill is None else self.dense_prefill
        spans = fresh_prefill_spans(metadata, num_decodes, sliding_window, soft_cap) if is_dense else None
        if spans is not None and num_decodes == 0 and spans == [(0, q.shape[0])]:
            return dense_prefill_attention(q, k, v, spans, scale)  # one fresh prompt: SDPA's output as is
        out = torch.empty_like(q)  # [T, Hq, D]; rows past query_start_loc[-1] unwritten
        if num_decodes:
            # NOTE: the prefill kernel gives a one-token query a program per query head, each reading
            # its KV head's whole context (a GQA group reads it group times over); the decode kernel
            # reads it once for the group. In a mixed step of a few prefills and hundreds of long
            # decodes that is most of the step's attention time.
            if self._every_variant is not None:
                launches = [launch._asdict() for launch in self._every_variant]
            else:
                launches = [{"num_kv_splits": self._num_kv_splits(num_decodes, metadata.max_seq_len, k_cache)}]
            for launch in launches:
                kern.paged_decode_attention(
                    q[:num_decodes], k_cache, v_cache, metadata.block_tables[:num_decodes],
                    metadata.seq_lens[:num_decodes], scale, out=out[:num_decodes], k_scale=self.k_scale,
                    v_scale=self.v_scale, sliding_window=sliding_window, soft_cap=soft_cap, **launch,
                )
        if spans is not None:
            dense_prefill_attention(q, k, v, spans, scale, out)
            return out
        # The prefill kernel finds each sequence's query rows at its query_start_loc entry, so the
        # rest of the batch keeps its absolute row offsets into q and out.
        kern.paged_prefill_attention(
            q, k_cache, v_cache, metadata.block_tables[num_decodes:], metadata.query_start_loc[num_decodes:],
            metadata.seq_lens[num_decodes:], metadata.max_query_len, scale, out=out,
            k_scale=self.k_scale, v_scale=self.v_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        )
        return out

    def forward_unrotated(
        self,
        q: torch.Tensor,  # [T, Hq, D], before the rotary
        k: torch.Tensor,  # [T, Hkv, D], before the rotary
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        rotary: Rotary,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        """`forward` of q and k not yet rotated (nor QK-normed). A decode-only step rotates, writes the new
        K/V and attends in the decode kernel's one launch (`kernels/decode_prologue.py`); others rotate first."""
        if not (metadata.is_decode_only and q.shape[0] == metadata.num_seqs):
            rotary.apply(q, k)
            return self.forward(q, k, v, k_cache, v_cache, metadata, scale, sliding_window, soft_cap)
        append = self._kernels.DecodeAppend(k, v, metadata.slot_mapping, rotary)
        return self._kernels.paged_decode_attention(
            q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, scale,
            num_kv_splits=self._num_kv_splits(metadata.num_seqs, metadata.max_seq_len, k_cache),
            k_scale=self.k_scale, v_scale=self.v_scale, sliding_window=sliding_window, soft_cap=soft_cap,
            append=append,
        )  # [T, Hq, D]

    def _num_kv_splits(self, num_seqs: int, max_seq_len: int, k_cache: torch.Tensor) -> int:
        key = (num_seqs, max_seq_len)
        if key != self._splits_for:
            self._splits = self._kernels.choose_num_kv_splits(num_seqs, k_cache.shape[2], max_seq_len, k_cache.device)
            self._splits_for = key
        return self._splits
