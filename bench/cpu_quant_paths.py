"""The CPU quantized matmul's paths (AMX, AVX-512, and the dense prefill path: expand, then BLAS) timed
alternately in one process over the embedded SmolLM2's projection shapes, per number of activation rows.

    python bench/cpu_quant_paths.py [--rows 1 4 8 16 32 64] [--rounds 7] [--paths amx avx512 dense] [--cold-mb 64]

NOTE: this machine's speed swings 30-60% between minutes: each round times every path back to back, and
the table gives each path's median over rounds. `--cold-mb N` cycles each call through copies of the weight
filling N MB, so that its blocks come from memory as in a model step (whose weights do not fit in L2).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference_service.cpu_kernels.quant import (  # noqa: E402
    QuantizedWeight,
    QuantType,
    dequantize_rows,
    load_extension,
    quant_matmul,
)

# isort: split
# NOTE: after inference_service, which sets GOMP_SPINCOUNT before torch first loads libgomp (the engine's setting).
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# (name, output rows, input columns, type): SmolLM2-135M's fused projections and its lm_head.
SHAPES = [("qkv", 960, 576, QuantType.Q4_1), ("o", 576, 576, QuantType.Q4_1),
          ("gate_up", 3072, 576, QuantType.Q4_1), ("down", 576, 1536, QuantType.Q4_1),
          ("lm_head", 49152, 576, QuantType.Q8_0)]


def random_weights(qtype: QuantType, rows: int, cols: int, rng: np.random.Generator,
                   cold_mb: int = 0) -> list[QuantizedWeight]:
    """One random weight, and as many separate copies of it as fill `cold_mb` MB."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, qtype.block_bytes), dtype=np.uint8)
    blocks[:, :, 0:2] = rng.uniform(-0.1, 0.1, (rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    if qtype is QuantType.Q4_1:
        blocks[:, :, 2:4] = rng.uniform(-0.2, 0.2, (rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    num_copies = max(1, -(-(cold_mb << 20) // blocks.nbytes))
    return [QuantizedWeight.from_gguf_blocks(blocks.reshape(rows, -1).copy(), qtype) for _ in range(num_copies)]


def time_call(fn, min_seconds: float = 0.05) -> float:
    """Seconds a call, the best of repeated calls over at least `min_seconds`."""
    fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64], help="activation rows")
    parser.add_argument("--rounds", type=int, default=7, help="alternations of the paths")
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], help="projections to time")
    parser.add_argument("--paths", nargs="+", default=["amx", "avx512", "dense"], help="paths to alternate")
    parser.add_argument("--cold-mb", type=int, default=0, help="cycle through copies of the weight filling N MB")
    args = parser.parse_args()
    ext = load_extension()
    if ext.limit_instruction_set("amx") != "amx":
        sys.exit("no AMX on this CPU")
    ext.set_amx_min_rows(1)
    rng = np.random.default_rng(0)

    def run_path(path: str, x: torch.Tensor, weights: itertools.cycle) -> None:
        weight = next(weights)
        if path == "dense":
            F.linear(x, dequantize_rows(weight))
        else:
            ext.limit_instruction_set(path)
            quant_matmul(x, weight)

    paths = args.paths
    ratio = "avx512" in paths and "amx" in paths
    print(f"{'shape':<8} {'rows':>4} " + " ".join(f"{p + ' us':>10}" for p in paths)
          + (f" {'avx512/amx':>10}" if ratio else ""))
    for name, rows, cols, qtype in SHAPES:
        if name not in args.shapes:
            continue
        weights = itertools.cycle(random_weights(qtype, rows, cols, rng, args.cold_mb))
        for num_rows in args.rows:
            x = torch.randn(num_rows, cols)
            times = {p: [] for p in paths}
            for _ in range(args.rounds):
                for p in paths:
                    times[p].append(time_call(lambda: run_path(p, x, weights)))
            med = {p: statistics.median(t) * 1e6 for p, t in times.items()}
            print(f"{name:<8} {num_rows:>4} " + " ".join(f"{med[p]:>10.1f}" for p in paths)
                  + (f" {med['avx512'] / med['amx']:>10.2f}" if ratio else ""), flush=True)
    ext.limit_instruction_set("amx")


if __name__ == "__main__":
    main()
