"""Probe: where the one-row int4 tensor-core GEMV's time goes (experiment, issue 18).

1. Pure weight streaming (int32 words summed, a register-prefetch pipeline of 3 tiles) with the GEMV's access
   pattern (BN rows x SEG bytes of a [N, K/2] row-major weight per step) against a tile-contiguous layout.
2. The real kernel (plain, one row) on the row-major layout against the row tiles (`with_row_tiles`).
Results of 2026-11-27 (H200): bench/results/h200-2026-11-27/tc_gemv_probe.json.
Weights rotated over > 256 MB. Prints JSON lines.

Usage: python bench/tc_gemv_probe.py OUT.json        (GPU, ~30 s)
       ncu --kernel-name regex:_quant_gemv_tc_kernel --launch-skip 1|4 --launch-count 1 \
           python bench/tc_gemv_probe.py --ncu          (row-major | row tiles)
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gpu_common import graph_seconds  # noqa: E402

from kernels.quant_gemv_tc import quant_gemv_tc  # noqa: E402
from kernels.quant_gemv_tc_tiles import quant_gemv_tc_config  # noqa: E402
from kernels.quant_layout import IntPackedWeight  # noqa: E402
from kernels.quant_tiles import with_row_tiles  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


@triton.jit
def _stream(q_ptr, out_ptr, N, W, stride, BLOCK_N: tl.constexpr, SEG: tl.constexpr, SPLIT,
            TILED: tl.constexpr):
    """Sum of int32 words: rows pid_n's tile, words of split pid_k; SEG words a row a step."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, SEG)
    per = W // SPLIT
    w0 = pid_k * per
    if TILED:
        base = q_ptr + (pid_n * (W // SEG)).to(tl.int64) * (BLOCK_N * SEG) + (r[:, None] * SEG + c[None, :])
        step = BLOCK_N * SEG
        at = base + (w0 // SEG) * step
    else:
        base = q_ptr + (pid_n * BLOCK_N + r[:, None]).to(tl.int64) * stride + c[None, :]
        step = SEG
        at = base + w0
    n = per // SEG
    acc = tl.zeros((BLOCK_N, SEG), dtype=tl.int32)
    t0 = tl.load(at)
    t1 = tl.load(at + step)
    t2 = tl.load(at + 2 * step)
    for i in range(3, n + 3):
        nxt = tl.load(at + i * step, mask=(tl.zeros((BLOCK_N, SEG), tl.int32) + i) < n, other=0)
        acc ^= t0
        t0 = t1
        t1 = t2
        t2 = nxt
    tl.store(out_ptr + pid_n * BLOCK_N + r, tl.sum(acc, 1))


def tile_layout(qs: torch.Tensor, bn: int, seg_bytes: int) -> torch.Tensor:
    n, kb = qs.shape
    return qs.view(n // bn, bn, kb // seg_bytes, seg_bytes).permute(0, 2, 1, 3).contiguous().view(n, kb)


def ncu_target() -> None:
    """gate_up plain at one row, default tiles: 3 launches row-major, then 3 tile-contiguous."""
    n, k = 28672, 4096
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    s = (torch.rand(n, k // 128, device="cuda") * 0.002).to(torch.float16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for t in (False, True):
        w = IntPackedWeight(4, 128, q, s, zero=8)
        w = with_row_tiles(w) if t else w
        for _ in range(3):
            quant_gemv_tc(x, w)
    torch.cuda.synchronize()


def main() -> None:
    if sys.argv[1] == "--ncu":
        return ncu_target()
    out_path = sys.argv[1]
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for name, n, k in SHAPES:
        copies = max(2, (256 << 20) // (n * k // 2))
        qs = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda") for _ in range(copies)]
        num_bytes = sum(q.numel() for q in qs)
        out = torch.empty(n, dtype=torch.int32, device="cuda")
        for bn in (64, 128):
            for seg in (64, 128, 256):
                tiled = {t: [tile_layout(q, bn, seg) for q in qs] for t in (False, True)}
                for warps in (4, 8):
                    tiles = n // bn
                    for split in (1, 2, 4, 8):
                        if (k // 2) // split < 4 * seg or tiles * split > 8 * sms:
                            continue
                        for t in (False, True):
                            def call(t=t, split=split, warps=warps, bn=bn, seg=seg, tiled=tiled):
                                for q in tiled[t]:
                                    w = q.view(torch.int32)
                                    _stream[(tiles, split)](w, out, n, w.shape[1], w.stride(0), BLOCK_N=bn,
                                                            SEG=seg // 4, SPLIT=split, TILED=t, num_warps=warps)
                            try:
                                s = graph_seconds(call)
                            except Exception as exc:  # noqa: BLE001
                                emit({"proj": name, "case": "stream", "error": str(exc)[:100]})
                                continue
                            emit({"proj": name, "case": "stream", "tiled": t, "bn": bn, "seg": seg, "warps": warps,
                                  "split": split, "us": round(s / copies * 1e6, 2),
                                  "gbs": round(num_bytes / s / 1e9, 1)})
                del tiled
        # the real kernel, plain, one row
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        cfg = quant_gemv_tc_config(n, k, 128, x.device)
        scales = [(torch.rand(n, k // 128, device="cuda") * 0.002).to(torch.float16) for _ in qs]
        for bn in (64, 128):
            for split in sorted({1, 2, 4, cfg["split_k"], 2 * cfg["split_k"]}):
                if split > 8 or (n // bn) * split > 8 * sms:
                    continue
                for t in (False, True):
                    ws = [IntPackedWeight(4, 128, q, sc, zero=8) for q, sc in zip(qs, scales)]
                    ws = [with_row_tiles(w) for w in ws] if t else ws
                    ref = quant_gemv_tc(x, IntPackedWeight(4, 128, qs[0], scales[0], zero=8), block_n=bn, split_k=split)
                    got = quant_gemv_tc(x, ws[0], block_n=bn, split_k=split)
                    same = bool(torch.equal(ref, got))
                    s = graph_seconds(lambda ws=ws, t=t, bn=bn, split=split: [
                        quant_gemv_tc(x, w, block_n=bn, split_k=split) for w in ws])
                    emit({"proj": name, "case": "tc_plain", "tiled": t, "bn": bn, "split": split, "same": same,
                          "default": (bn, split) == (cfg["block_n"], cfg["split_k"]),
                          "us": round(s / copies * 1e6, 2), "gbs": round(num_bytes / s / 1e9, 1)})
        del qs
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
