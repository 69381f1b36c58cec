"""Paged attention in plain torch: the CPU backend, and the reference the GPU kernels are tested against.

Decode sequences (one query each) are attended together: each context's keys and values are gathered
head-major into [S * Hkv, L, D] (L the longest context; shorter ones padded, an additive mask hides the
padding), and two batched matmuls around a softmax attend every (sequence, kv head) at once, its G query
heads as G query rows. Sequences with several queries (prefill chunks) are attended one at a time.

Index tensors derived from the metadata (which slots to write, where each decode context lives) are
built once per model step and reused by every layer.

A layer may attend over the last `sliding_window` keys only (Mistral, Gemma's local layers: key j is
seen from query position i when i - window < j <= i) and soft-cap its scores (Gemma 2: s -> c tanh(s / c),
before the mask, as HF does); such layers take the explicit-score path, others SDPA.

A decode-only step in float32 on the CPU (no window, no soft cap) is one C++ call per layer instead
(`cpu_kernels`, which writes the keys and values and attends, with the same arithmetic): at batch 1 the dozen
torch ops above cost more than the attention itself.

The cache may hold float16 (`--kv-cache-dtype fp16`) under float32 activations: keys and values are rounded to
it when written and widened back when read, the arithmetic staying in the activations' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference_service.attention.metadata import AttentionMetadata
from inference_service.cpu_kernels.quant import cpu_ops_for


@dataclass
class _StepPlan:
    """What every layer of one step reuses."""

    write_slots: torch.Tensor  # [W] int64 cache slots of the rows written
    write_rows: torch.Tensor | None  # [W] int64 rows of k/v to write; None = all rows, in order
    decode_rows: torch.Tensor | None  # [S_dec] int64 query rows of decode sequences; None = every row
    # Rows of the cache viewed as [num_slots * Hkv, D] holding each decode context, head-major:
    # [S_dec * Hkv * L] int64, entry (s, h, t) = slot of token t of sequence s, times Hkv, plus h.
    decode_gather: torch.Tensor | None
    decode_mask: torch.Tensor | None  # [S_dec * Hkv, 1, L] additive: 0 = attend, -inf = padding
    # (first slot, seq_len) when the only decode sequence's context lies in consecutive blocks: it is
    # attended in place, a view of the cache, with no gather and no mask.
    decode_span: tuple[int, int] | None
    prefill: list[tuple[int, int, int, torch.Tensor | None]]  # (row start, row end, seq_len, slots [L] or None)
    # What the explicit decode path needs when it is not built up front (decode_span set): the decode
    # sequences' block tables and lengths; and the padding masks with each sliding window, by window.
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    window_masks: dict | None = None


def _capped_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                              scale: float, soft_cap: float | None) -> torch.Tensor:
    """q [B, M, D], k and v [B, L, D], additive mask broadcastable to [B, M, L] -> [B, M, D]."""
    scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)  # [B, M, L]
    if soft_cap is not None:
        scores = scores.div_(soft_cap).tanh_().mul_(soft_cap)
    if mask is not None:
        scores = scores.add_(mask)
    return torch.bmm(scores.softmax(-1), v)


def _context_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                   block_size: int) -> torch.Tensor:
    """Cache slot of every context position: [S, max_len] int64, positions past a seq's length -> 0."""
    positions = torch.arange(max_len, device=block_tables.device)  # [L]
    block_cols = (positions // block_size).clamp_(max=block_tables.shape[1] - 1)  # [L]
    blocks = block_tables.index_select(1, block_cols).long()  # [S, L]
    slots = blocks * block_size + positions % block_size  # [S, L]
    return slots.masked_fill_(positions[None, :] >= seq_lens[:, None].long(), 0)


class TorchPagedAttention:
    """`AttentionBackend` built on `torch.nn.functional.scaled_dot_product_attention`."""

    name = "torch_paged"

    def __init__(self, use_cpu_kernels: bool = True) -> None:
        self.use_cpu_kernels = use_cpu_kernels
        self._plan_metadata: AttentionMetadata | None = None
        self._plan_key: tuple | None = None  # (k_cache.shape[1:], q's dtype) the plan was built for
        self._plan: _StepPlan | None = None
        self._cpu_ops = None  # the C++ decode path, found on the first float32 CPU step
        self._cpu_ops_checked = not use_cpu_kernels

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
        if (metadata.max_query_len == 1 and k_cache.dtype in (torch.float32, torch.float16) and sliding_window is None
                and soft_cap is None and q.shape[0] == metadata.seq_lens.shape[0]):
            if not self._cpu_ops_checked:
                self._cpu_ops, self._cpu_ops_checked = cpu_ops_for(q), True
            if self._cpu_ops is not None:
                return self._cpu_ops.paged_decode_attention(q, k, v, k_cache, v_cache, metadata.block_tables,
                                                            metadata.seq_lens, metadata.slot_mapping, scale)
        plan = self._get_plan(metadata, k_cache, q.dtype)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        if plan.write_rows is None:
            k_flat.index_copy_(0, plan.write_slots, k.to(k_flat.dtype))
            v_flat.index_copy_(0, plan.write_slots, v.to(v_flat.dtype))
        elif plan.write_slots.numel():
            k_flat.index_copy_(0, plan.write_slots, k.index_select(0, plan.write_rows).to(k_flat.dtype))
            v_flat.index_copy_(0, plan.write_slots, v.index_select(0, plan.write_rows).to(v_flat.dtype))

        if not plan.prefill and plan.decode_rows is None:
            # Every row is one decode sequence: the output is the batched result itself.
            return self._decode(q, k_cache, v_cache, plan, scale, sliding_window, soft_cap)

        out = torch.empty_like(q)  # [T, Hq, D]
        if plan.decode_rows is not None:
            out.index_copy_(0, plan.decode_rows, self._decode(q.index_select(0, plan.decode_rows),
                                                                k_cache, v_cache, plan, scale, sliding_window,
                                                                soft_cap))
        for start, end, seq_len, slots in plan.prefill:
            if sliding_window is not None or soft_cap is not None:
                out[start:end] = self._prefill_explicit(q[start:end], k[start:end], v[start:end], k_flat, v_flat,
                                                        slots, seq_len, scale, sliding_window, soft_cap)
                continue
            if slots is None:
                # No cached prefix: the new keys are the whole context, and the mask is plain causal.
                ctx_k, ctx_v, causal_mask = k[start:end], v[start:end], None
            else:
                ctx_k = k_flat.index_select(0, slots).to(q.dtype)  # [L, Hkv, D]
                ctx_v = v_flat.index_select(0, slots).to(q.dtype)
                query_len = end - start
                # Query j sits at position seq_len - query_len + j and sees keys up to it.
                rows = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
                causal_mask = torch.arange(seq_len, device=q.device)[None, :] <= rows  # [Tq, L]
            # NOTE: with a batch dimension: unbatched (3-D) inputs take torch's math fallback on the CPU, 3-5x
            # slower than its fused kernel (a 2k prompt of SmolLM2's heads: 447 -> 92 ms a layer, this machine)
            attn = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1).unsqueeze(0),  # [1, Hq, Tq, D]
                ctx_k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
                ctx_v.transpose(0, 1).unsqueeze(0),
                attn_mask=causal_mask,
                is_causal=causal_mask is None,
                scale=scale,
                enable_gqa=True,
            )[0]  # [Hq, Tq, D]
            out[start:end] = attn.transpose(0, 1)
        return out

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _prefill_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor,
                          v_flat: torch.Tensor, slots: torch.Tensor | None, seq_len: int, scale: float,
                          sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
        """One sequence's queries q [Tq, Hq, D] over its context, with a window and/or a soft cap."""
        query_len, num_heads, head_dim = q.shape
        ctx_k, ctx_v = (k, v) if slots is None else (k_flat.index_select(0, slots).to(q.dtype),
                                                     v_flat.index_select(0, slots).to(q.dtype))
        num_kv_heads = ctx_k.shape[1]
        group = num_heads // num_kv_heads
        rows = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]  # [Tq, 1] query positions
        cols = torch.arange(seq_len, device=q.device)[None, :]  # [1, L] key positions
        allowed = cols <= rows
        if sliding_window is not None:
            allowed &= rows - cols < sliding_window
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        # Query heads of one kv head become G * Tq rows of it: [Hkv, G * Tq, D].
        grouped_q = q.permute(1, 0, 2).reshape(num_kv_heads, group * query_len, head_dim)
        mask = mask.repeat(group, 1)  # [G * Tq, L]
        out = _capped_softmax_attention(grouped_q, ctx_k.transpose(0, 1), ctx_v.transpose(0, 1), mask, scale,
                                        soft_cap)  # [Hkv, G * Tq, D]
        return out.view(num_heads, query_len, head_dim).transpose(0, 1)

    @classmethod
    def _decode(cls, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _StepPlan,
                scale: float, sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
        """q [S, Hq, D] (one query per sequence) -> [S, Hq, D]."""
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        if plan.decode_span is not None and soft_cap is None:
            first, length = plan.decode_span
            if sliding_window is not None and length > sliding_window:  # the window: the span's tail
                first, length = first + length - sliding_window, sliding_window
            grouped_q = q.view(num_seqs, num_kv_heads, group, head_dim)  # [1, Hkv, G, D]
            ctx_k = k_cache.view(-1, num_kv_heads, head_dim)[first:first + length].unsqueeze(0).transpose(1, 2)
            ctx_v = v_cache.view(-1, num_kv_heads, head_dim)[first:first + length].unsqueeze(0).transpose(1, 2)
            # ctx_k, ctx_v: [1, Hkv, L, D] views of the cache (widened copies of a float16 one)
            ctx_k, ctx_v = ctx_k.to(q.dtype), ctx_v.to(q.dtype)
            attn = F.scaled_dot_product_attention(grouped_q, ctx_k, ctx_v, scale=scale)
            return attn.reshape(num_seqs, num_heads, head_dim)
        # NOTE: the G query heads sharing a kv head become G query rows of that head, so GQA needs no
        # copy of the keys; with a single query per sequence there is nothing causal to mask. One
        # batched matmul over (sequence, kv head) pairs costs far less than SDPA's per-pair kernel here.
        batch = num_seqs * num_kv_heads
        gather, mask = cls._decode_gather_and_mask(plan, num_kv_heads, k_cache.shape[1], q.dtype, sliding_window)
        ctx_k = k_cache.view(-1, head_dim).index_select(0, gather).view(batch, -1, head_dim).to(q.dtype)
        ctx_v = v_cache.view(-1, head_dim).index_select(0, gather).view(batch, -1, head_dim).to(q.dtype)
        # ctx_k, ctx_v: [S * Hkv, L, D]
        grouped_q = q.reshape(batch, group, head_dim)  # [S * Hkv, G, D]
        if soft_cap is not None:
            return _capped_softmax_attention(grouped_q, ctx_k, ctx_v, mask, scale, soft_cap).view(
                num_seqs, num_heads, head_dim)
        scores = torch.baddbmm(mask, grouped_q, ctx_k.transpose(1, 2), alpha=scale)  # [S * Hkv, G, L]
        return torch.bmm(scores.softmax(-1), ctx_v).view(num_seqs, num_heads, head_dim)

    @staticmethod
    def _decode_gather_and_mask(plan: _StepPlan, num_kv_heads: int, block_size: int, dtype: torch.dtype,
                                sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gather rows, additive mask) of the decode contexts; the mask hides padding and, with a
        window, the keys before it. Built once a step per window."""
        if plan.decode_gather is None:  # the span path was planned; this layer needs the general one
            plan.decode_gather, plan.decode_mask = _gather_and_mask(plan.decode_tables, plan.decode_lens,
                                                                    num_kv_heads, block_size, dtype)
        if sliding_window is None:
            return plan.decode_gather, plan.decode_mask
        if plan.window_masks is None:
            plan.window_masks = {}
        if sliding_window not in plan.window_masks:
            max_len = plan.decode_mask.shape[-1]
            lens = plan.decode_lens.long()
            before = torch.arange(max_len, device=lens.device)[None, :] < (lens[:, None] - sliding_window)  # [S, L]
            hidden = before[:, None, None, :].expand(-1, num_kv_heads, 1, -1).reshape(-1, 1, max_len)
            plan.window_masks[sliding_window] = plan.decode_mask.masked_fill(hidden, float("-inf"))
        return plan.decode_gather, plan.window_masks[sliding_window]

    def _get_plan(self, metadata: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype) -> _StepPlan:
        key = (k_cache.shape[1:], dtype)
        if metadata is not self._plan_metadata or key != self._plan_key:
            self._plan = self._build_plan(metadata, k_cache.shape[1], k_cache.shape[2], dtype)
            self._plan_metadata, self._plan_key = metadata, key
        return self._plan

    @staticmethod
    def _build_plan(metadata: AttentionMetadata, block_size: int, num_kv_heads: int, dtype: torch.dtype
                    ) -> _StepPlan:
        slot_mapping = metadata.slot_mapping.long()
        valid = slot_mapping >= 0
        if bool(valid.all()):
            write_slots, write_rows = slot_mapping, None
        else:
            write_rows = valid.nonzero().squeeze(1)
            write_slots = slot_mapping.index_select(0, write_rows)

        starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        decode_seqs = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
        prefill = []
        for i in range(len(seq_lens)):
            start, end = starts[i], starts[i + 1]
            if end - start > 1:
                slots = None
                if seq_lens[i] != end - start:
                    slots = _context_slots(metadata.block_tables[i:i + 1], metadata.seq_lens[i:i + 1],
                                           seq_lens[i], block_size)[0]
                prefill.append((start, end, seq_lens[i], slots))

        decode_rows = decode_gather = decode_mask = decode_span = None
        if decode_seqs:
            device = metadata.block_tables.device
            all_decode = len(decode_seqs) == len(seq_lens) and starts[-1] == len(seq_lens) \
                and slot_mapping.shape[0] == len(seq_lens)
            if all_decode:
                tables, lens = metadata.block_tables, metadata.seq_lens
            else:
                index = torch.tensor(decode_seqs, device=device)
                tables, lens = metadata.block_tables.index_select(0, index), metadata.seq_lens.index_select(0, index)
                decode_rows = torch.tensor([starts[i] for i in decode_seqs], device=device)
            decode_lens = [seq_lens[i] for i in decode_seqs]
            max_len = max(decode_lens)
            if len(decode_seqs) == 1 and device.type == "cpu":
                # NOTE: batch-1 decode is the latency case; a fresh sequence's blocks are usually
                # consecutive, and attending a view skips two gathers and the mask in every layer.
                num_blocks = -(-max_len // block_size)
                blocks = tables[0, :num_blocks].tolist()
                if blocks == list(range(blocks[0], blocks[0] + num_blocks)):
                    decode_span = (blocks[0] * block_size, max_len)
            if decode_span is None:
                decode_gather, decode_mask = _gather_and_mask(tables, lens, num_kv_heads, block_size, dtype)
            return _StepPlan(write_slots, write_rows, decode_rows, decode_gather, decode_mask, decode_span, prefill,
                             decode_tables=tables, decode_lens=lens)
        return _StepPlan(write_slots, write_rows, decode_rows, decode_gather, decode_mask, decode_span, prefill)


def _gather_and_mask(tables: torch.Tensor, lens: torch.Tensor, num_kv_heads: int, block_size: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the cache viewed as [num_slots * Hkv, D] holding each decode context, head-major
    ([S * Hkv * L]), and the additive padding mask [S * Hkv, 1, L]."""
    device = tables.device
    max_len = int(lens.max())
    slots = _context_slots(tables, lens, max_len, block_size)  # [S_dec, L], padding -> slot 0
    heads = torch.arange(num_kv_heads, device=device)
    gather = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).view(-1)
    padding = torch.arange(max_len, device=device)[None, :] >= lens[:, None].long()  # [S_dec, L]
    mask = torch.zeros(padding.shape, dtype=dtype, device=device).masked_fill_(padding, float("-inf"))
    return gather, mask[:, None, None, :].expand(-1, num_kv_heads, 1, -1).reshape(-1, 1, max_len)
