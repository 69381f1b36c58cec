"""Tiles of the tensor-core decode GEMV (`kernels.quant_gemv_tc`) against the CUDA-core one (`quant_gemv`).

Llama-3-8B's four projections in int4 (GPTQ layout, group 128; `--awq`: a zeros plane), each called as
the fused decoder calls it (qkv / gate_up: RMSNorm prologue, o: residual, down: SiLU gate + residual),
plain (`plain_tc`) and, past 2 rows, through the tensor-core GEMM (`plain_gemm`), at each of --rows (tile
variants at 1 row); weights rotated over > 256 MB so every call reads memory, CUDA-graph replays, GB/s of
packed weight read. Prints one JSON line a case and writes them to --out.

Weights in row tiles as the engine loads them (`--row-major`: the plain layout); `split_tc`: the prologue in a
launch of its own, then the plain GEMV (one row's route, `kernels.quant_gemv.ONE_ROW`). `--few-warps`: at one
row, also programs of 1 and 2 warps (Triton's `mma.sync` instead of a warpgroup's `wgmma`) with K split deeper.

`--row-blocks`: large batches instead (--rows 64,256): the plain projections through the tensor-core GEMM
(`gemm`), bf16 cuBLAS on a bf16 weight of the same shape (`bf16`, the reference), and `quant_gemv_tc` in row
blocks, default and tile variants (block_m, block_n, warps, stages, split).

Usage: python bench/quant_gemv_tc_tune.py --out FILE [--rows 1,2,4,8,16] [--quick] [--row-major]  (GPU, ~2 min)
       python bench/quant_gemv_tc_tune.py --out FILE --row-blocks --rows 64,256
"""

# isort: split
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import triton  # noqa: E402
from gpu_common import graph_seconds  # noqa: E402

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.norm import rms_norm  # noqa: E402
from kernels.quant_gemm import quant_gemm  # noqa: E402
from kernels.quant_gemv import quant_gemv  # noqa: E402
from kernels.quant_gemv_tc import quant_gemv_tc  # noqa: E402
from kernels.quant_gemv_tc_tiles import quant_gemv_tc_config  # noqa: E402
from kernels.quant_layout import IntPackedWeight  # noqa: E402
from kernels.quant_tiles import with_row_tiles  # noqa: E402

PROJECTIONS = [("qkv", 6144, 4096, ("norm",)), ("o", 4096, 4096, ("residual",)),
               ("gate_up", 28672, 4096, ("norm",)), ("down", 4096, 14336, ("gated", "residual"))]


def random_weight(n: int, k: int, awq: bool, row_major: bool) -> IntPackedWeight:
    """In row tiles as the engine loads it (`with_row_tiles`), or `row_major`."""
    groups = (n, k // 128)
    w = IntPackedWeight(4, 128, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda"),
                        (torch.rand(groups, device="cuda") * 0.002).to(torch.float16),
                        zeros=torch.randint(0, 16, groups, dtype=torch.uint8, device="cuda") if awq else None,
                        zero=8)
    return w if row_major else with_row_tiles(w)


def split_prologue(x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """x through the fused options' prologue in a launch of its own (what one row does: `quant_gemv.ONE_ROW`)."""
    if kwargs["gated"]:
        return silu_and_mul(x)
    if "norm_weight" in kwargs:
        return rms_norm(x, kwargs["norm_weight"], 1e-6)
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="1,16")
    p.add_argument("--awq", action="store_true")
    p.add_argument("--quick", action="store_true", help="defaults only, no tile variants")
    p.add_argument("--plain", action="store_true", help="tile variants without the fused options")
    p.add_argument("--row-major", action="store_true", help="weights in the row-major layout, not row tiles")
    p.add_argument("--few-warps", action="store_true", help="one row: also 1- and 2-warp programs")
    p.add_argument("--row-blocks", action="store_true", help="large batches: row blocks against the GEMM and bf16")
    args = p.parse_args()
    if args.row_blocks:
        return row_blocks(args)
    rows_out = []
    for num_rows in [int(r) for r in args.rows.split(",")]:
        for name, n, k, options in PROJECTIONS:
            copies = max(2, (256 << 20) // (n * k // 2))
            ws = [random_weight(n, k, args.awq, args.row_major) for _ in range(copies)]
            x = torch.randn(num_rows, 2 * k if "gated" in options else k, device="cuda", dtype=torch.bfloat16)
            kwargs = {"gated": "gated" in options}
            if "norm" in options:
                kwargs["norm_weight"] = torch.rand(k, device="cuda", dtype=torch.bfloat16)
            if "residual" in options:
                kwargs["residual"] = torch.randn(num_rows, n, device="cuda", dtype=torch.bfloat16)
            num_bytes = sum(w.nbytes for w in ws)
            default = quant_gemv_tc_config(n, k, 128, x.device, not args.plain and options != ("residual",),
                                           not args.row_major)
            plain = x[:, :k] if "gated" in options else x
            cases = [("cuda_cores", lambda w, **t: quant_gemv(x, w, block_n=None, block_k=1024, **kwargs), {}),
                     ("tc_default", lambda w, **t: quant_gemv_tc(x, w, **kwargs, **t), {}),
                     ("plain_tc", lambda w, **t: quant_gemv_tc(plain, w), {}),
                     ("split_tc", lambda w, **t: quant_gemv_tc(split_prologue(x, kwargs), w,
                                                                residual=kwargs.get("residual")), {})]
            if num_rows > 2:
                cases.append(("plain_gemm", lambda w, **t: quant_gemm(plain, w), {}))
            if not args.quick and num_rows == 1:
                split = default["split_k"]
                for block_n, block_k in ((64, 128), (128, 128), (256, 64)):
                    for split_k in sorted({max(1, split // 2), split, split * 2} if block_n < 256 else {1, 2, 4, 8}):
                        for stages in (2, 3):
                            tile = {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_stages": stages}
                            cases.append((f"tc_{block_n}_{block_k}_s{split_k}_{stages}", None, tile))
                for warps in (1, 2) if args.few_warps else ():
                    for split_k in (split, split * 2, split * 4):
                        for stages in (3, 4):
                            tile = {"block_n": 64, "split_k": split_k, "num_warps": warps, "num_stages": stages}
                            cases.append((f"tc_64_w{warps}_s{split_k}_{stages}", None, tile))
            for label, fn, tile in cases:
                call = fn or ((lambda w, **t: quant_gemv_tc(plain, w, **t)) if args.plain
                              else (lambda w, **t: quant_gemv_tc(x, w, **kwargs, **t)))
                try:
                    seconds = graph_seconds(lambda call=call, tile=tile: [call(w, **tile) for w in ws])
                except Exception as exc:  # noqa: BLE001 - a tile past the shared-memory budget
                    print(json.dumps({"rows": num_rows, "proj": name, "case": label, "error": str(exc)[:120]}))
                    continue
                row = {"rows": num_rows, "proj": name, "case": label, "us": round(seconds / copies * 1e6, 2),
                       "gbs": round(num_bytes / seconds / 1e9, 1), "default": default}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
            ws.clear()
            torch.cuda.empty_cache()
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


def row_blocks(args) -> None:
    """Large batches: the plain projections, every --rows, GEMM / bf16 cuBLAS / row-block tiles."""
    rows_out = []
    for num_rows in [int(r) for r in args.rows.split(",")]:
        for name, n, k, _ in PROJECTIONS:
            copies = max(2, (256 << 20) // (n * k // 2))
            ws = [random_weight(n, k, args.awq, args.row_major) for _ in range(copies)]
            x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
            dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            default = quant_gemv_tc_config(n, k, 128, x.device, tiled=not args.row_major, num_rows=num_rows)
            cases = [("bf16", lambda w, **t: x @ dense.T, {}), ("gemm", lambda w, **t: quant_gemm(x, w), {}),
                     ("tc_default", None, {})]
            if not args.quick:
                block_ms = sorted({min(b, max(16, triton.next_power_of_2(num_rows))) for b in (64, 128, 256)})
                for block_m in block_ms:
                    for block_n in (64, 128):
                        for warps in (4, 8):
                            for stages in (3, 4):
                                for split_k in sorted({1, default["split_k"]}):
                                    tile = {"block_m": block_m, "block_n": block_n, "num_warps": warps,
                                            "num_stages": stages, "split_k": split_k}
                                    cases.append((f"tc_m{block_m}_n{block_n}_w{warps}_{stages}_s{split_k}", None,
                                                  tile))
            for label, fn, tile in cases:
                call = fn or (lambda w, **t: quant_gemv_tc(x, w, **t))
                try:
                    seconds = graph_seconds(lambda call=call, tile=tile: [call(w, **tile) for w in ws])
                except Exception as exc:  # noqa: BLE001 - a tile past the shared-memory or register budget
                    print(json.dumps({"rows": num_rows, "proj": name, "case": label, "error": str(exc)[:120]}))
                    continue
                us = seconds / copies * 1e6
                row = {"rows": num_rows, "proj": name, "case": label, "us": round(us, 2),
                       "tflops": round(2 * num_rows * n * k / us / 1e6, 1), "default": default}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
            ws.clear()
            torch.cuda.empty_cache()
    best = {}
    for r in rows_out:
        key = (r["rows"], r["proj"])
        if r["case"].startswith("tc_m") and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for (num_rows, proj), r in sorted(best.items()):
        ref = {c["case"]: c["us"] for c in rows_out if c["rows"] == num_rows and c["proj"] == proj}
        print(f"rows {num_rows} {proj}: bf16 {ref.get('bf16')} gemm {ref.get('gemm')} tc_default "
              f"{ref.get('tc_default')} best {r['case']} {r['us']} us")
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
