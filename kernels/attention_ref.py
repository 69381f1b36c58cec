"""Float64 torch references for the paged attention kernels (decode and prefill share them)."""

from __future__ import annotations

import torch


def gather_context_ref(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int, scale: float = 1.0
) -> torch.Tensor:
    """The first `num_tokens` tokens of one sequence's paged K or V, as float64 [num_tokens, H, D]."""
    page_size = cache.shape[1]
    num_pages = -(-num_tokens // page_size)
    pages = cache[block_table[:num_pages].long()]  # [pages, page_size, H, D]
    return pages.reshape(-1, cache.shape[2], cache.shape[3])[:num_tokens].to(torch.float64) * scale


def attention_ref(
    q: torch.Tensor,  # [num_queries, Hq, D] float64
    k: torch.Tensor,  # [num_keys, Hkv, D] float64
    v: torch.Tensor,
    q_positions: torch.Tensor,  # [num_queries] absolute positions among the keys
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal softmax attention in float64: query at position p sees keys j <= p (and p - j < W)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    key_pos = torch.arange(k.shape[0], device=q.device)
    allowed = key_pos[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed &= (q_positions[:, None] - key_pos[None, :]) < sliding_window
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain torch paged decode attention in float64; returns float64 [num_seqs, Hq, D]."""
    outs = []
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:  # padding sequence: the kernel writes zeros
            outs.append(torch.zeros((1,) + tuple(q.shape[1:]), dtype=torch.float64, device=q.device))
            continue
        k = gather_context_ref(k_cache, block_tables[i], seq_len, k_scale)
        v = gather_context_ref(v_cache, block_tables[i], seq_len, v_scale)
        pos = torch.tensor([seq_len - 1], device=q.device)
        outs.append(attention_ref(q[i : i + 1].to(torch.float64), k, v, pos, scale, sliding_window, soft_cap))
    return torch.cat(outs) if outs else q.new_empty(q.shape, dtype=torch.float64)
