"""The greedy sampler's argmax over a batch's logits in one launch.

Each program takes one chunk of a row: every value becomes an int64 key, the value's order in the high half and
its index, reversed, in the low half, so that one integer maximum picks the largest value and, among equal ones,
the first. The program stores its chunk's largest key and counts itself in (as `split_k`'s partials do); the last
of the row's programs to arrive takes the maximum of their keys and writes the row's index. torch's argmax of a
long row took one thread block a row (~27 us for a 128k vocabulary on an H100) and the chunked torch argmax six
small launches; this is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import is_interpreter, next_pow2, require, require_dtype
from kernels.split_k import after_arrivals, count_in

# Below every real key: a masked lane never wins.
_NO_KEY = tl.constexpr(-(2**63) + 1)
_BLOCK = 2048

_WORKSPACES: dict = {}


@triton.jit
def _first_max_key(x, offs):
    """int64 keys whose maximum is the first maximum of `x` (NaN the largest value, -0.0 equal to 0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    ordered = tl.where(bits >= 0, bits, -magnitude)  # monotonic in the float value; -0.0 and 0.0 both 0
    ordered = tl.where(magnitude > 0x7F800000, 0x7FFFFFFF, ordered)  # NaN above +inf
    return (ordered.to(tl.int64) << 32) + (0x7FFFFFFF - offs).to(tl.int64)


@triton.jit
def _argmax_kernel(
    x_ptr,  # [num_rows, V] float32
    out_ptr,  # [num_rows] int64
    keys_ptr,  # [num_rows, BLOCK_CHUNKS] int64 workspace
    count_ptr,  # [num_rows] int32, zero between launches
    stride_x,
    V,
    num_chunks,
    BLOCK: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=mask, other=0.0)
    best = tl.max(tl.where(mask, _first_max_key(x, offs), _NO_KEY), 0)
    tl.store(keys_ptr + row * BLOCK_CHUNKS + chunk, best)
    if count_in(count_ptr, row, chunk) == num_chunks - 1:
        after_arrivals(chunk)
        cols = tl.arange(0, BLOCK_CHUNKS)
        keys = tl.load(keys_ptr + row * BLOCK_CHUNKS + cols, mask=cols < num_chunks, other=_NO_KEY,
                       cache_modifier=".cg")
        best = tl.max(keys, 0)
        tl.store(out_ptr + row, (0x7FFFFFFF - best.to(tl.int32)).to(tl.int64))  # the low half: < 2**31
        tl.store(count_ptr + row, 0)


def _workspace(device: torch.device, num_rows: int, block_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and zeroed counters for `num_rows` rows (one set a device: launches on one stream never overlap).

    NOTE: not `split_k.workspace`: that one is captured in the decode graphs, and growing it here, outside them,
    would free what they still write to."""
    keys, counts = _WORKSPACES.get(device, (None, None))
    if keys is None or counts.numel() < num_rows or keys.numel() < num_rows * block_chunks:
        rows = max(num_rows, 256)
        keys = torch.empty(rows * max(block_chunks, 64), dtype=torch.int64, device=device)
        counts = torch.zeros(rows, dtype=torch.int32, device=device)
        _WORKSPACES[device] = (keys, counts)
    return keys, counts


def argmax_rows(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x.argmax(dim=-1) of [num_rows, V] float32 with a contiguous last dimension: [num_rows] int64, the first
    maximum of each row (NaN counts as the maximum, as in torch)."""
    require(x.dim() == 2, lambda: f"x: expected [num_rows, V], got {tuple(x.shape)}")
    require_dtype("x", x, (torch.float32,))
    require(x.stride(1) == 1, "x: last dimension must be contiguous")
    num_rows, vocab = x.shape
    require(0 < vocab < 2**31, lambda: f"x: vocabulary of {vocab} columns")
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    require(out.shape == (num_rows,) and out.dtype == torch.int64, "out: expected [num_rows] int64")
    if num_rows == 0:
        return out
    block = min(_BLOCK, next_pow2(vocab))
    num_chunks = triton.cdiv(vocab, block)
    block_chunks = next_pow2(num_chunks)
    keys, counts = _workspace(x.device, num_rows, block_chunks)
    opts = {} if is_interpreter() else {"num_warps": 4}
    _argmax_kernel[(num_chunks, num_rows)](x, out, keys, counts, x.stride(0), vocab, num_chunks, BLOCK=block,
                                           BLOCK_CHUNKS=block_chunks, **opts)
    return out
