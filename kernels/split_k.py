"""Deterministic split-K for the tensor-core GEMVs (`quant_gemv_tc`, `fp8_gemv_tc`): narrow layers split K over
several programs so that the grid fills the GPU; each program stores its fp32 partial [BN, ROWS] to a workspace and
the program that arrives last at its column tile (a counter, acquire-release) sums the partials in split order,
so the result does not depend on which program finished first, then zeroes the workspace and the counter again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import _INTERPRETED

_WORKSPACES: dict = {}


def split_k_workspace(device: torch.device, num_floats: int, num_counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed fp32 workspace and int32 counters for split-K, kept zero by the kernels (one per device;
    launches on one stream never overlap: each waits for the previous kernel before it touches them)."""
    ws, counts = _WORKSPACES.get(device, (None, None))
    if ws is None or ws.numel() < num_floats or counts.numel() < num_counters:
        # NOTE: sized for every layer of a large model at once (16 MB): a CUDA graph capture must not
        # be the call that grows it
        ws = torch.zeros(max(num_floats, 1 << 22), dtype=torch.float32, device=device)
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
def arrive(acc, ws_ptr, count_ptr, pid_n, split, slab, ws_at, n_mask, SPLIT_K: tl.constexpr):
    """Stores this program's partial `acc` at `ws_at` in split `split`'s slab of `slab` floats; whether it
    arrived last at column tile `pid_n`."""
    tl.store(ws_ptr + split * slab + ws_at, acc, mask=n_mask[:, None])
    # NOTE: one thread's release does not publish the other threads' stores (seen on an H200: the rows
    # other lanes held went missing): each thread fences its own before the arrival
    fence_gpu(pid_n)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    return arrived == SPLIT_K - 1


@triton.jit
def sum_partials(ws_ptr, count_ptr, pid_n, slab, ws_at, n_mask, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 ROWS: tl.constexpr):
    """In the program that arrived last: every split's partial summed in split order [BN, ROWS] fp32, the
    workspace and the counter left zero."""
    tl.debug_barrier()
    fence_gpu(pid_n)
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(ws_ptr + split * slab + ws_at, mask=n_mask[:, None], other=0.0, cache_modifier=".cg")
    # NOTE: the zeros are stored by other threads than the ones that loaded (the layouts differ):
    # every load before any of them
    tl.debug_barrier()
    for split in range(SPLIT_K):
        tl.store(ws_ptr + split * slab + ws_at, tl.zeros_like(acc), mask=n_mask[:, None])
    tl.store(count_ptr + pid_n, 0)
    return acc


def split_for(num_tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """Splits of K (a power of two) until the grid holds 1.5 programs an SM, each split at least 4 K steps."""
    split = 1
    while num_tiles * split < 1.5 * num_sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return split


def split_args(device: torch.device, split: int, rows: int, n: int, num_tiles: int, dummy: torch.Tensor):
    """(workspace, counters) for a launch of `split` splits over [rows, n] partials, or `dummy` twice."""
    return split_k_workspace(device, split * rows * n, num_tiles) if split > 1 else (dummy, dummy)

