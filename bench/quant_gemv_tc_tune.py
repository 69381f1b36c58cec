"""Tiles of the tensor-core decode GEMV (`kernels.quant_gemv_tc`) against the CUDA-core one (`quant_gemv`).

Llama-3-8B's four projections in int4 (GPTQ layout, group 128; `--awq`: a zeros plane), each called as
the fused decoder calls it (qkv / gate_up: RMSNorm prologue, o: residual, down: SiLU gate + residual),
plain (`plain_tc`) and, past 2 rows, through the tensor-core GEMM (`plain_gemm`), at each of --rows (tile
variants at 1 row); weights rotated over > 256 MB so every call reads memory, CUDA-graph replays, GB/s of
packed weight read. Prints one JSON line a case and writes them to --out.

Weights in row tiles as the engine loads them (`--row-major`: the plain layout); `split_tc`: the prologue in a
launch of its own, then the plain GEMV (one row's route, `kernels.quant_gemv.ONE_ROW`).

Usage: python bench/quant_gemv_tc_tune.py --out FILE [--rows 1,2,4,8,16] [--quick] [--row-major]  (GPU, ~2 min)
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
from gpu_common import graph_seconds  # noqa: E402

from kernels.activation import silu_and_mul  # noqa: E402
from kernels.norm import rms_norm  # noqa: E402
from kernels.quant_gemm import quant_gemm  # noqa: E402
from kernels.quant_gemv import quant_gemv  # noqa: E402
from kernels.quant_gemv_tc import quant_gemv_tc, quant_gemv_tc_config  # noqa: E402
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
    args = p.parse_args()
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


if __name__ == "__main__":
    main()
