"""EXPERIMENT, GPU only (Triton >= 3.6 with Gluon): the Gluon int4 GEMV against float64 and against the shipped
`quant_gemv_tc` (same codes), then each alone in a CUDA graph of 20 calls, Llama-3-8B's projections.

    python bench/experiments/gluon_int4_gemv/gpu_check.py --out DIR   (a JSON line a case; DIR/gluon_int4.json)
"""
import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # bench/
import gpu_common  # noqa: E402
import torch  # noqa: E402
from int4_gemv_gluon import int4_gemv, repack_thread_major  # noqa: E402

from kernels.quant_gemv_tc import quant_gemv_tc  # noqa: E402
from kernels.quant_layout import pack_int  # noqa: E402
from kernels.quant_tiles import with_row_tiles  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graph_us(fn, calls=20):
    """us a call of fn, `calls` of them back to back in one CUDA graph (so PDL overlaps neighbours, as in a step)."""
    return round(gpu_common.graph_seconds(lambda: [fn() for _ in range(calls)]) / calls * 1e6, 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.int32)
        scales = (torch.rand(n, k // 128, device="cuda", generator=gen) * 0.02 + 0.001).to(torch.float16)
        shipped = with_row_tiles(pack_int(codes, 4, 128, scales, zero=8))
        words = repack_thread_major(codes.to(torch.uint8))
        w64 = ((codes - 8).double() * scales.double().repeat_interleave(128, 1))
        for m in (1, 2, 8):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            resid = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.double() @ w64.T + resid.double()
            row = {"proj": name, "n": n, "k": k, "rows": m}
            try:
                y_ship = quant_gemv_tc(x, shipped, residual=resid)
                row["shipped_err"] = float(((y_ship.double() - ref).norm() / ref.norm()))
                for split in (1, 2, 4, 8):
                    if k // split < 256 or (k // split) % 128:
                        continue
                    y = int4_gemv(x, words, scales, n, k, split_k=split, residual=resid)
                    row[f"gluon_s{split}_err"] = float(((y.double() - ref).norm() / ref.norm()))
                    y3 = int4_gemv(x, words, scales, n, k, split_k=split, residual=resid, depth=3)
                    row[f"gluon_s{split}_depth3_equal"] = bool(torch.equal(y3, y))
                    row[f"gluon_s{split}_vs_shipped_max"] = float((y.float() - y_ship.float()).abs().max())
                if m == 1:
                    row["shipped_us"] = graph_us(lambda: quant_gemv_tc(x, shipped, residual=resid))
                    for split in (1, 2, 4, 8):
                        if k // split < 256 or (k // split) % 128:
                            continue
                        row[f"gluon_s{split}_us"] = graph_us(
                            lambda: int4_gemv(x, words, scales, n, k, split_k=split, residual=resid))
                        row[f"gluon_s{split}_pdl_us"] = graph_us(
                            lambda: int4_gemv(x, words, scales, n, k, split_k=split, residual=resid, use_pdl=True))
                        row[f"gluon_s{split}_depth3_us"] = graph_us(
                            lambda: int4_gemv(x, words, scales, n, k, split_k=split, residual=resid, depth=3))
            except Exception:  # noqa: BLE001 - an experiment: report and go on
                row["error"] = traceback.format_exc()[-1500:]
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gluon_int4.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
