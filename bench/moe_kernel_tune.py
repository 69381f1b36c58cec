"""Times `kernels.fused_moe` (replayed from CUDA graphs) at Qwen3-30B-A3B's shapes (bf16) over block sizes, next to the bytes-read
bound; prints the fastest per token count. `--decode`: only the decode GEMVs (1 and 4 tokens), gate_up's tiles and
down's swept apart (the other at its default). Usage: python bench/moe_kernel_tune.py [--decode] (CUDA)."""

from __future__ import annotations

import functools
import itertools
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels import fused_moe  # noqa: E402

E, K, H, I = 128, 8, 2048, 768


def _graph_us(fn) -> float:
    """Microseconds of one call replayed from a CUDA graph (as the engine's decode step runs it: no
    launch overhead), median of do_bench's runs over 20 replays a graph."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    return do_bench(graph.replay) * 1e3 / 20


def decode_sweep(w13: torch.Tensor, w2: torch.Tensor, bw: float) -> None:
    """The decode GEMVs' tiles, each kernel's swept with the other's at its default."""
    for tokens in (1, 4):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, K, device="cuda"), -1).float()
        bound_us = ids.unique().numel() * 3 * H * I * 2 / bw * 1e6
        run = functools.partial(fused_moe, x, w13, w2, weights, ids, use_gemv=True)
        default = _graph_us(run)
        sweeps = {"gate_up": [dict(block_n=bn, block_k=bk, num_warps=nw) for bn, bk, nw in
                              itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8))],
                  "down": [dict(down_tiles=t)
                           for t in itertools.product((2, 4, 8, 16, 32), (32, 64, 128, 256), (4, 8))]}
        for name, configs in sweeps.items():
            results = []
            for config in configs:
                try:
                    results.append((_graph_us(functools.partial(run, **config)), config))
                except Exception:  # noqa: BLE001 - a config that does not fit
                    continue
            results.sort(key=lambda r: r[0])
            print(f"decode tokens {tokens} {name}: bound {bound_us:.1f} us (both), default {default:.1f} us, best "
                  f"{[f'{us:.1f}us {config}' for us, config in results[:5]]}", flush=True)


def main() -> None:
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    bw = 3.0e12
    if "--decode" in sys.argv:
        decode_sweep(w13, w2, bw)
        return
    for tokens in (1, 4, 32, 168):
        x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, K, device="cuda"), -1).to(torch.bfloat16)
        touched = ids.unique().numel()
        bound_us = touched * 3 * H * I * 2 / bw * 1e6
        results = []
        gemm_configs = itertools.product((False,), (16, 32, 64), (32, 64, 128), (64, 128), (4, 8))
        gemv_configs = itertools.product((True,), (0,), (8, 16, 32), (128, 256, 512), (4, 8))
        for gemv, bm, bn, bk, nw in itertools.chain(gemm_configs, gemv_configs):
            try:
                us = _graph_us(functools.partial(fused_moe, x, w13, w2, weights, ids, block_m=bm or None,
                                                 block_n=bn, block_k=bk, num_warps=nw, use_gemv=gemv))
            except Exception:  # noqa: BLE001 - a config that does not fit
                continue
            results.append((us, "gemv" if gemv else f"gemm bm{bm}", bn, bk, nw))
        results.sort()
        default = _graph_us(functools.partial(fused_moe, x, w13, w2, weights, ids))
        print(f"tokens {tokens}: experts touched {touched}, bound {bound_us:.1f} us, default {default:.1f} us, "
              f"best {[f'{r[0]:.1f}us {r[1]} bn{r[2]} bk{r[3]} w{r[4]}' for r in results[:6]]}", flush=True)


if __name__ == "__main__":
    main()
