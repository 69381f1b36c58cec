"""K split across the programs of a decode GEMV (`quant_gemv_tc`'s narrow layers): each program writes its fp32
partial of an output tile to a workspace and counts itself in; the last to arrive sums the partials in split
order (deterministic) and finishes the tile. The counters are left zeroed; a partial is read only after its split
wrote it, so the workspace holds whatever the last call left and needs no clearing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import _INTERPRETED

# NOTE: sized for every layer of a large model at once (16 MB): a CUDA graph capture must not be the call that
# grows it, so the GEMVs' default splits never need more
WORKSPACE_FLOATS = 1 << 22

_WORKSPACES: dict = {}


def workspace(device: torch.device, num_floats: int, num_counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 workspace and int32 counters for split-K, the counters zeroed and kept zero by the kernels (one
    per device; launches on one stream never overlap: each waits for the previous kernel before it touches them)."""
    ws, counts = _WORKSPACES.get(device, (None, None))
    if ws is None or ws.numel() < num_floats or counts.numel() < num_counters:
        ws = torch.zeros(max(num_floats, WORKSPACE_FLOATS), dtype=torch.float32, device=device)
        counts = torch.zeros(max(num_counters, 1 << 14), dtype=torch.int32, device=device)
        _WORKSPACES[device] = (ws, counts)
    return ws, counts


@triton.jit
def fence_gpu(token):
    """This thread's memory operations ordered at GPU scope (`__threadfence`); `token`: any scalar."""
    if not _INTERPRETED:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.u32 $0, $1;", "=r,r", [token], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def count_in(count_ptr, index, token):
    """Counts this program in at counter `index` once each of its threads' stores is published: how many programs
    had counted in before it (the last one reads what all of them stored, after `after_arrivals`)."""
    # NOTE: one thread's release does not publish the other threads' stores (seen on an H200: the rows other
    # lanes held went missing): each thread fences its own before the arrival, and the last program's threads
    # fence after it (`after_arrivals`), so the counter itself is relaxed (acq_rel drained and invalidated once
    # more: qkv alone 7.96 -> 7.67 us, o 6.37 -> 6.11 on an H200)
    fence_gpu(token)
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + index, 1, sem="relaxed", scope="gpu")


@triton.jit
def after_arrivals(token):
    """In the last program to `count_in`: every other program's stores visible to each of this one's threads (read
    them with `cache_modifier=".cg"`, past the multiprocessor's L1)."""
    tl.debug_barrier()
    fence_gpu(token)


@triton.jit
def arrive(partial, ws_ptr, count_ptr, ws_at, ws_mask, slab, tile, token):
    """Stores this program's partial (split `tl.program_id(1)`, `slab` floats a split) and counts it in at
    counter `tile`: how many splits had arrived before it (SPLIT_K - 1: this program sums them)."""
    tl.store(ws_ptr + tl.program_id(1) * slab + ws_at, partial, mask=ws_mask)
    return count_in(count_ptr, tile, token)


@triton.jit
def sum_partials(ws_ptr, count_ptr, ws_at, ws_mask, slab, tile, token, SPLIT_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """In the last program to `arrive`: the splits' partials summed in split order [BN, BM]; the counter zeroed."""
    after_arrivals(token)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # unrolled: the loads in flight together, summed in split order
        acc += tl.load(ws_ptr + split * slab + ws_at, mask=ws_mask, other=0.0, cache_modifier=".cg")
    tl.store(count_ptr + tile, 0)
    return acc
