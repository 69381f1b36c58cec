"""Fresh prompts' attention through torch's fused SDPA (cuDNN's attention on Hopper) instead of the paged kernel.

A prompt with no cached prefix needs no keys but its own, and this step has them in contiguous tensors: the
paged prefill kernel reads them back from the cache page by page (and, with an fp8 cache, widens them), at
236-265 TFLOP/s for a 4k prompt on an H200, where cuDNN's fused attention reaches 535 (0.26 vs 0.58 ms a
layer; 1k: 0.033 vs 0.154 ms; `bench/prefill_attention_tune.py`, bench/results/h200-2026-11-26). Prefix-cache hits,
later chunks of a chunked prompt, sliding windows narrower than the prompt and soft-capped scores (Gemma 2)
keep the paged kernel.

NOTE: with an fp8 cache a fresh prompt attends over its keys and values before they are quantized (as
FlashAttention backends of vLLM do for prefills); its later decode steps read the fp8 copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from inference_service.attention.metadata import AttentionMetadata

# Below this many fresh query tokens the paged kernel's one launch costs less than per-prompt SDPA calls.
MIN_DENSE_PREFILL_TOKENS = 512
# A step of more fresh prompts than this stays one paged launch instead of a host loop of SDPA calls.
MAX_DENSE_PREFILL_SEQS = 4
# torch picks the first that takes the inputs; cuDNN's is the Hopper kernel, FlashAttention-2's the fallback.
_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]


def fresh_prefill_spans(metadata: AttentionMetadata, first_seq: int, sliding_window: int | None = None,
                        soft_cap: float | None = None) -> list[tuple[int, int]] | None:
    """The query row spans of sequences `first_seq..` when each is a whole fresh prompt (its context is exactly
    this step's queries) and together they are worth the dense path; else None. Host lists only: no sync."""
    if soft_cap is not None:
        return None
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    num_seqs = len(seq_lens) - first_seq
    if not 0 < num_seqs <= MAX_DENSE_PREFILL_SEQS:
        return None
    spans = []
    for i in range(first_seq, len(seq_lens)):
        lo, hi = starts[i], starts[i + 1]
        if hi - lo != seq_lens[i] or (sliding_window is not None and seq_lens[i] > sliding_window):
            return None
        spans.append((lo, hi))
    if spans[-1][1] - spans[0][0] < MIN_DENSE_PREFILL_TOKENS:
        return None
    return spans


def dense_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    spans: list[tuple[int, int]],
    scale: float,
    out: torch.Tensor | None = None,  # [T, Hq, D]; rows of `spans` written
) -> torch.Tensor:
    """Causal attention of each span's queries over the span's own keys (grouped-query heads as the paged
    kernels: query head h reads KV head h // (Hq // Hkv)). Writes into `out`; without one, `spans` must be the
    one span of every row, and SDPA's own output comes back (no copy: a single fresh prompt's step)."""
    with sdpa_kernel(_BACKENDS, set_priority=True):
        for lo, hi in spans:
            o = F.scaled_dot_product_attention(  # [1, Hq, L, D]
                q[lo:hi].transpose(0, 1).unsqueeze(0), k[lo:hi].transpose(0, 1).unsqueeze(0),
                v[lo:hi].transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True,
            )[0].transpose(0, 1)  # [L, Hq, D]
            if out is None:
                assert spans == [(0, q.shape[0])], spans
                return o
            out[lo:hi].copy_(o)
    return out

