"""Paged decode attention at serving batch sizes (256-512 sequences), fp8 and bf16 KV caches: launch variants timed
against the copy bandwidth of the same run (issue 18's offline fp8 target and issue 17's 384 streams, where this
kernel is most of a decode step).

Variants: the launcher's defaults and other tiles (block_n, num_warps, num_stages). Pages are scattered (`--pages random`, as in a long-lived cache) or in order (`in_order`, as a fresh
engine allocates them). Llama-3-8B's attention: 32 query heads, 8 KV heads, head_dim 128, pages of 16 tokens.
Each case is a CUDA graph of calls over disjoint inputs (kernels_bench.Bench), median time; GB/s counts the
bytes the kernel must move (K/V read, q read, output written).

The cache is laid out head-major (each KV head's page one run: `kv_cache.new_kv_cache`, the engine's layout on a
GPU) or token-major (`--layouts head,token` times both).

Usage: python bench/decode_attention_tune.py [--out DIR] [--shapes 384x1024,256x1536] [--pages random,in_order]
       [--dtypes fp8,bf16] [--variants default,128/4/3,...] [--layouts head,token]
       [--page-sizes 16,32,64]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels_bench import BF16, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, PAGE, Bench, bench_ceilings  # noqa: E402

from inference_service.engine.kv_cache import new_kv_cache  # noqa: E402
from kernels import FP8_DTYPE, choose_num_kv_splits, paged_decode_attention  # noqa: E402

# block_n/num_warps/num_stages; "default": the launcher's defaults
VARIANTS = "default,64/4/3,64/4/5,128/4/3,128/4/4,128/4/5,128/8/3,128/8/4,256/4/2,256/4/3"


def parse_variant(spec: str) -> tuple[int | None, int | None, int | None]:
    """(block_n, num_warps, num_stages) of one --variants entry."""
    return (None, None, None) if spec == "default" else tuple(map(int, spec.split("/")))


def setup(b: Bench, batch: int, ctx: int, cache_dtype: torch.dtype, pages_in_order: bool, head_major: bool,
          page: int = PAGE) -> dict:
    pages = -(-ctx // page)
    kv_bytes = batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 * cache_dtype.itemsize
    num_sets = max(2, -(-(1 << 30) // kv_bytes))  # > 1 GiB of K/V cycled: past L2
    num_blocks = num_sets * batch * pages + 1
    shape = (num_blocks, page, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (new_kv_cache(shape, cache_dtype, "cuda", head_major) for _ in range(2))
    for cache in (k_cache, v_cache):
        cache.copy_(torch.randn(shape, dtype=BF16, device="cuda"))
    order = torch.arange(1, num_blocks) if pages_in_order else torch.randperm(num_blocks - 1) + 1
    return {"k": k_cache, "v": v_cache, "tables": order.to(torch.int32).view(num_sets, batch, pages).cuda(),
            "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device="cuda"),
            "q": torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=BF16, device="cuda"),
            "bytes": kv_bytes + 2 * batch * NUM_Q_HEADS * HEAD_DIM * 2, "num_sets": num_sets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/decode_attention_tune"))
    parser.add_argument("--shapes", default="384x1024,384x1536,256x1536")
    parser.add_argument("--pages", default="random,in_order")
    parser.add_argument("--dtypes", default="fp8,bf16")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--layouts", default="head,token", help="the cache's memory order: head (each head's page one "
                        "run, the engine's default on a GPU), token ([tokens, heads, dim])")
    parser.add_argument("--page-sizes", default=str(PAGE),
                        help="comma-separated tokens a cache page (serve --block-size)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    b = Bench(smoke=False)
    ceilings = bench_ceilings(b)
    copy = ceilings["copy_GBps"]
    print(f"copy {copy:.0f} GB/s", flush=True)
    results = {"device": torch.cuda.get_device_name(), "ceilings": ceilings, "cases": []}
    for shape in args.shapes.split(","):
        batch, ctx = map(int, shape.split("x"))
        for dtype_name in args.dtypes.split(","):
            cache_dtype = FP8_DTYPE if dtype_name == "fp8" else BF16
            for pages, layout, page in itertools.product(args.pages.split(","), args.layouts.split(","),
                                                         map(int, args.page_sizes.split(","))):
                s = setup(b, batch, ctx, cache_dtype, pages == "in_order", layout == "head", page)
                splits = choose_num_kv_splits(batch, NUM_KV_HEADS, ctx, torch.device("cuda"))
                row = {"batch": batch, "ctx": ctx, "cache": dtype_name, "pages": pages, "layout": layout,
                       "page_size": page, "splits": splits}
                out = torch.empty_like(s["q"])
                for name in args.variants.split(","):
                    block_n, warps, stages = parse_variant(name)
                    calls = [(lambda r=r, s=s, out=out: paged_decode_attention(
                        s["q"], s["k"], s["v"], s["tables"][r], s["seq_lens"], HEAD_DIM ** -0.5, out=out,
                        num_kv_splits=splits, k_scale=0.5, v_scale=0.5, block_n=block_n, num_warps=warps,
                        num_stages=stages)) for r in range(s["num_sets"])]
                    try:
                        ms = b.time_calls(calls)
                        gbs = s["bytes"] / (ms * 1e-3) / 1e9
                        row[name] = {"us": round(ms * 1e3, 1), "GBps": round(gbs), "of_copy": round(gbs / copy, 3)}
                    except Exception as e:  # noqa: BLE001 - a tile the compiler cannot fit: say so, go on
                        row[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
                results["cases"].append(row)
                print(f"{batch}x{ctx} {dtype_name} {pages} {layout} page={page} splits={splits}: " + ", ".join(
                    f"{k} {v['us']} us {v['of_copy']:.2f}" if "us" in v else f"{k} failed"
                    for k, v in row.items() if isinstance(v, dict)), flush=True)
                del s
                b.free()
                with open(os.path.join(args.out, "decode_attention_tune.json"), "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
