"""Prefill-sized fp8 GEMMs against bf16 on Llama-3-8B's projections (issue 18's offline fp8 target).

Per (rows, projection), CUDA events over repeated calls, TFLOP/s:
  bf16        torch.mm of bf16 activations and weights (cuBLAS): the reference
  shipped     `kernels.fp8_gemm.fp8_linear` (activations quantized per row, then `_scaled_mm` row-wise, fast
              accumulation unless KERNELS_FP8_FAST_ACCUM=0)
  quantize    `kernels.fp8_quant.quantize_fp8_rows` alone
  rowwise     `_scaled_mm` with row-wise scales alone (what `shipped` calls after quantizing)
  tensorwise  `_scaled_mm` with one scale each
  *_fast      the same with use_fast_accum (the fp8 accumulator not promoted to fp32 every few K steps)
`rel_err` beside rowwise and rowwise_fast: ||y - ref|| / ||ref|| against the same fp8 operands multiplied in
float64, so it is the accumulation's error alone (the operands' rounding to e4m3 is not in it).
and (`fusion`) the input quantizers fused into the launches that compute the input (`rms_norm_fp8`, the GATED
quantizer) against the launches they replace, at the first of --rows.

Usage: python bench/fp8_prefill_gemm.py [--rows 2048,8192] [--only gemm,fusion] [--out DIR]   (CUDA, ~1 minute)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import fused_add_rms_norm, rms_norm_fp8, silu_and_mul  # noqa: E402
from kernels.fp8_gemm import Fp8Weight, fp8_linear, quantize_fp8_groups  # noqa: E402
from kernels.fp8_quant import quantize_fp8_rows, quantize_fp8_silu_and_mul  # noqa: E402

PROJECTIONS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def fusion(rows: int, hidden: int = 4096, intermediate: int = 14336) -> dict:
    """us a call: each fused quantizer against the launches it replaces (one scale a row; the SiLU's also in
    128-column groups)."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    gate_up = torch.randn(rows, 2 * intermediate, device="cuda", dtype=torch.bfloat16)
    cases = {
        "norm_then_quantizer": lambda: quantize_fp8_rows(
            fused_add_rms_norm(x, residual, weight, 1e-6, out=torch.empty_like(x)), hidden),
        "rms_norm_fp8": lambda: rms_norm_fp8(x, residual, weight, 1e-6),
        "silu_then_quantizer": lambda: quantize_fp8_rows(silu_and_mul(gate_up), intermediate),
        "silu_quantizer": lambda: quantize_fp8_silu_and_mul(gate_up, intermediate),
        "silu_quantizer_group128": lambda: quantize_fp8_silu_and_mul(gate_up, 128),
    }
    result = {name: round(time_ms(fn) * 1e3, 1) for name, fn in cases.items()}
    print(rows, "rows, fused quantizers, us:", result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2048,8192")
    parser.add_argument("--only", default="gemm,fusion")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/fp8_prefill_gemm"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    sections = args.only.split(",")
    if "fusion" in sections:
        results["fusion_us"] = fusion(int(args.rows.split(",")[0]))
    for rows in map(int, args.rows.split(",") if "gemm" in sections else []):
        per_proj = {}
        for name, n, k in PROJECTIONS:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            wq, ws = quantize_fp8_groups(w16.float(), k)  # per output channel: scales [N, 1]
            w = Fp8Weight(wq, ws, 1, k)
            xq, x_scale = quantize_fp8_rows(x, k)
            ws_row = w.scale.view(1, n).contiguous()
            one = torch.ones(1, 1, device="cuda")
            flops = 2.0 * rows * n * k
            cases = {
                "bf16": lambda: torch.mm(x, w16.t()),
                "shipped": lambda: fp8_linear(x, w),
                "quantize": lambda: quantize_fp8_rows(x, k),
                "rowwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=ws_row,
                                                    out_dtype=torch.bfloat16),
                "rowwise_fast": lambda: torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=ws_row,
                                                         out_dtype=torch.bfloat16, use_fast_accum=True),
                "tensorwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                "tensorwise_fast": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                            out_dtype=torch.bfloat16, use_fast_accum=True),
            }
            ref = (xq.double() * x_scale.double()) @ (wq.double() * ws.double()).t()
            row = {}
            for case in ("rowwise", "rowwise_fast"):
                err = (cases[case]().double() - ref).norm() / ref.norm()
                row[case] = {"rel_err": f"{err.item():.2e}"}
            del ref
            for case, fn in cases.items():
                try:
                    ms = time_ms(fn)
                    row[case] = {**row.get(case, {}), "us": round(ms * 1e3, 1), "tflops": round(flops / ms / 1e9, 1)}
                except Exception as e:  # noqa: BLE001 - a case torch does not support here: say so, go on
                    row[case] = {"error": repr(e)[:200]}
            per_proj[name] = row
            print(rows, name, {c: v.get("tflops", v.get("error")) for c, v in row.items()},
                  {c: row[c].get("rel_err") for c in ("rowwise", "rowwise_fast")}, flush=True)
        total = {c: round(sum(per_proj[p][c].get("us", float("nan")) for p in per_proj), 1) for c in per_proj["o"]}
        results["rows"][rows] = {"per_projection": per_proj, "layer_us": total}
        print(rows, "a layer's projections, us:", total, flush=True)
    with open(os.path.join(args.out, "fp8_prefill_gemm.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
