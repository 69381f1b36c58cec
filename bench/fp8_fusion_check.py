"""Times the fused fp8 input quantizers against the launches they replace (RMSNorm / SiLU-and-mul, then the
activation quantizer), at a prefill chunk's rows. Usage: python bench/fp8_fusion_check.py [--rows 8192]"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import fused_add_rms_norm, rms_norm_fp8, silu_and_mul  # noqa: E402
from kernels.fp8_quant import quantize_fp8_rows, quantize_fp8_silu_and_mul  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_prefill_gemm import time_ms  # noqa: E402


def us(fn) -> float:
    return time_ms(fn) * 1e3




def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192)
    args = parser.parse_args()
    m, hidden, inter = args.rows, 4096, 14336
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    gu = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
    print("norm+quant unfused", round(us(lambda: quantize_fp8_rows(fused_add_rms_norm(x, r, w, 1e-6, out=torch.empty_like(x)), hidden)), 1),
          "fused", round(us(lambda: rms_norm_fp8(x, r, w, 1e-6, hidden)), 1), "group 128 fused",
          round(us(lambda: rms_norm_fp8(x, r, w, 1e-6, 128)), 1), flush=True)
    print("silu+quant unfused", round(us(lambda: quantize_fp8_rows(silu_and_mul(gu), inter)), 1),
          "fused", round(us(lambda: quantize_fp8_silu_and_mul(gu, inter)), 1), "group 128 fused",
          round(us(lambda: quantize_fp8_silu_and_mul(gu, 128)), 1), flush=True)


if __name__ == "__main__":
    main()
