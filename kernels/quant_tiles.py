"""Row tiles: how 4-bit codes sit in GPU memory (`IntPackedWeight.tile_n`).

Row-major `qs` [N, K/2] makes one K step of a decode GEMV program (its rows x 64 bytes) a set of 64-byte runs
2 KB apart, which DRAM serves slowly. In row tiles the same bytes are stored tile after tile:
[N / tile_n, K / 128, tile_n, 64] (a tile: `tile_n` rows x 64 bytes, i.e. 128 columns, contiguous; the tiles of a
row band in K order), still shaped [N, K/2], so a program's K step is one contiguous run. An H200 streaming
Llama-3-8B's gate_up that way: 2.6-3.5 TB/s against 1.9-2.8; the tensor-core GEMV at one row 36.3 -> 26.6 us
(bench/tc_gemv_probe.py, bench/results/h200-2026-11-27).

The GPU loader stores every 4-bit weight that fits (`with_row_tiles`); every GPU kernel reads both layouts
(`qs_offsets`), and `row_major_qs` gives the plain bytes back for references, row concatenation and selection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_BYTES = 64  # a row's bytes in one tile (128 columns)
TILE_ROWS = (128, 64)  # the tiles' row counts, the first that divides N taken
_TILE_BYTES = tl.constexpr(TILE_BYTES)


def with_row_tiles(w):
    """An `IntPackedWeight` with `qs` in row tiles where it takes them (4-bit codes, N a multiple of 64, K of 128),
    else w itself."""
    n, k = w.shape
    tile_n = next((t for t in TILE_ROWS if n % t == 0), 0)
    if w.tile_n or w.bits != 4 or not tile_n or k % (2 * TILE_BYTES):
        return w
    rows = w.qs.view(n // tile_n, tile_n, k // 2 // TILE_BYTES, TILE_BYTES)  # [row band, row, tile, byte]
    qs = rows.permute(0, 2, 1, 3).contiguous().view(n, k // 2)
    return type(w)(**{**w.__dict__, "qs": qs, "tile_n": tile_n})


def row_major_qs(w) -> torch.Tensor:
    """An `IntPackedWeight`'s `qs` as the row-major [N, K/2] (or [N, K]) bytes whatever the layout."""
    if not w.tile_n:
        return w.qs
    n, kb = w.qs.shape
    tiles = w.qs.view(n // w.tile_n, kb // TILE_BYTES, w.tile_n, TILE_BYTES)  # [row band, tile, row, byte]
    return tiles.permute(0, 2, 1, 3).contiguous().view(n, kb)


@triton.jit
def qs_offsets(rows, byte_cols, stride_qs, TILE_N: tl.constexpr):
    """Offsets of bytes `byte_cols` [1, C] of rows `rows` [R, 1] (int64) in `qs` of either layout (TILE_N 0:
    row-major with rows `stride_qs` bytes apart; else row tiles of TILE_N rows, stride_qs = K / 2)."""
    if TILE_N == 0:
        return rows * stride_qs + byte_cols
    else:
        return ((rows // TILE_N) * (TILE_N * stride_qs) + (byte_cols // _TILE_BYTES) * (TILE_N * _TILE_BYTES)
                + (rows % TILE_N) * _TILE_BYTES + byte_cols % _TILE_BYTES)
