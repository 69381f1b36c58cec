"""Which tiles `kernels.quant_gemv_tc` runs a call in: row blocks or the GEMM past 16 rows, the tile shapes, and
how far K is split across programs (each choice with what it was measured against)."""

from __future__ import annotations

import torch
import triton

from kernels._common import num_sms
from kernels.quant_layout import IntPackedWeight
from kernels.split_k import WORKSPACE_FLOATS

MAX_ROWS = 16  # x^T padded to the MMA's smallest N: a decode call's rows, in one row block


def row_blocks_win(w: IntPackedWeight, num_rows: int) -> bool:
    """Whether this weight at num_rows (> 16) rows is faster in row blocks than through the tensor-core GEMM (an
    H100, 2026-11-28, bench/quant_gemv_tc_tune.py --row-blocks and bench/gpu_quant.py; Llama-3-8B's projections):
    up to 64 rows every one (64 rows: qkv 24.9 -> 21.2 us, o 25.0 -> 20.9, gate_up 70.2 -> 59.6, down 83.8 ->
    44.4); past that the wide ones (gate_up at 128 / 256 / 384 rows 128.8 / 197.7 / 350.9 -> 97.9 / 164.9 / 283.8
    us) and the long ones (down: 111.9 / 117.9 / 216.7 -> 93.0 / 114.0 / 179.3), while qkv and o measured as fast
    or slower at 256 rows; with a zeros plane (AWQ) up to 128 rows (gate_up / down at 128 rows 139.4 / 119.7 ->
    104.1 / 111.3 us, but all layers' projections at 256 rows 13.57 -> 14.08 ms). Groups of 128 columns or more
    (per channel): smaller ones (GGUF Q4_0's 32) scale four sub-tiles a K step, not measured in row blocks."""
    n, k = w.shape
    return w.group_size >= 128 and (num_rows <= 64 or ((n >= 16384 or k >= 8192)
                                                       and (w.zeros is None or num_rows <= 128)))


def quant_gemv_tc_config(n: int, k: int, group: int, device: torch.device, has_prologue: bool = False,
                         tiled: bool = False, num_rows: int = 1) -> dict:
    """Tiles an H100 and an H200 measured best at one row (bench/quant_gemv_tc_tune.py, 2026-11-27): 64 output
    columns a program (a warpgroup's MMA), 128 for the wide weights and for long ones with a fused prologue (which
    every program computes again: wider tiles share it) or in row tiles (`tiled`; down plain 21.4 -> 17.4 us on
    an H200, bench/tc_gemv_probe.py), a 128-wide K tile in sub-tiles of one group each (groups of 32: four), 3
    stages, and K split until the grid holds 1.5 programs an SM (while the partials fit the workspace; in row
    blocks only the long weights', to 0.75).
    Past MAX_ROWS rows (`row_blocks_win`'s weights), what an H100 measured best on 2026-11-28 at 64 and 256 rows:
    64-row blocks up to 64 rows, past that 128 (256 for the wide weights past 128 rows); 128 output columns on
    two warpgroups (one for the long weights in 128-row blocks), 64 on one for the small weights."""
    block_k = min(128, k & -k)
    sub_k = min(block_k, group & -group)
    num_warps = 4
    if num_rows <= MAX_ROWS:
        block_m = MAX_ROWS
        # NOTE: sub-tiles of 32 columns on 128-wide tiles take Triton's layouts through shared memory (SASS:
        # 8.2 instructions a weight against 5.3 on 64-wide tiles)
        wide = sub_k >= 64 and (n >= 16384 or (k >= 8192 and (has_prologue or tiled)))
        block_n = 128 if wide else 64
    else:
        block_m = 64 if num_rows <= 64 else 256 if n >= 16384 and num_rows > 128 else 128
        block_n = 64 if block_m == 64 and n < 16384 and k < 8192 else 128
        num_warps = 4 if block_n == 64 or (block_m == 128 and n < 16384) else 8
    # NOTE: a row block's partials are BM times a row's: split-K pays there only for the long weights, up to
    # 0.75 programs an SM (64 rows: qkv 21.2 us unsplit against 29.4 split 4; down 44.4 split 4, 51.4 split 8)
    fill = 1.5 if block_m == MAX_ROWS else 0.75 if k >= 8192 else 0
    split = k_splits(n, k, num_rows, block_n, block_m, block_k, fill, device)
    return {"block_n": block_n, "block_m": block_m, "block_k": block_k, "sub_k": sub_k, "split_k": split,
            "num_warps": num_warps, "num_stages": 3}


def k_splits(n: int, k: int, num_rows: int, block_n: int, block_m: int, block_k: int, fill: float,
             device: torch.device) -> int:
    """How many programs share a column tile's K: doubled until the grid holds `fill` programs an SM, while each
    keeps 4 K steps and the partials fit the workspace."""
    tiles = triton.cdiv(n, block_n) * triton.cdiv(num_rows, block_m)
    split = 1
    while (tiles * split < fill * num_sms(device) and k // (split * 2) >= 4 * block_k
           and 2 * split * triton.cdiv(num_rows, block_m) * block_m * n <= WORKSPACE_FLOATS):
        split *= 2
    return split
