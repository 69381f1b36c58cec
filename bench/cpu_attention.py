"""The CPU kernels' paged decode attention alone (`cpu_kernels/decode_attention*.cpp`) at the embedded SmolLM2's
heads (9 query heads over 3 KV heads of 64): 30 calls (a decode step's layers, each over its own cache, pages
shuffled) per (sequences x context) and cache dtype (float32, and float16 as `--kv-cache-dtype fp16` keeps it),
median and best of --repeats, the dtypes alternated --rounds times.

    python bench/cpu_attention.py [--shapes 16x75,16x200,16x500,1x200] [--cache-dtypes float32,float16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference_service.cpu_kernels.quant import load_extension  # noqa: E402

# isort: split
# NOTE: after inference_service, which sets GOMP_SPINCOUNT before torch first loads libgomp (the engine's setting).
import torch  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30


def step_ms(ext, num_seqs: int, context: int, cache_dtype: torch.dtype, repeats: int) -> tuple[float, float]:
    """(median, best) ms of 30 layers' attention for `num_seqs` sequences of `context` tokens each."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    caches = [tuple(torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(cache_dtype) for _ in range(2))
              for _ in range(NUM_LAYERS)]
    block_tables = torch.randperm(num_blocks).view(num_seqs, blocks_per_seq).to(torch.int32)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM)
    k, v = torch.randn(num_seqs, NUM_KV_HEADS, HEAD_DIM), torch.randn(num_seqs, NUM_KV_HEADS, HEAD_DIM)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    last = context - 1
    slot_mapping = (block_tables[:, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE).contiguous()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            ext.paged_decode_attention(q, k, v, k_cache, v_cache, block_tables, seq_lens, slot_mapping,
                                       HEAD_DIM ** -0.5)
        times.append(1e3 * (time.perf_counter() - start))
    times.sort()
    return times[len(times) // 2], times[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="16x75,16x200,16x500,1x200", help="sequences x context tokens")
    parser.add_argument("--cache-dtypes", default="float32", help="comma-separated: float32, float16")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    ext = load_extension()
    torch.manual_seed(0)
    for _ in range(args.rounds):
        for shape in args.shapes.split(","):
            num_seqs, context = map(int, shape.split("x"))
            for name in args.cache_dtypes.split(","):
                median, best = step_ms(ext, num_seqs, context, getattr(torch, name), args.repeats)
                print(f"{num_seqs:>3} x {context:<5} {name:<8}: 30 layers median {median:.2f} ms, best {best:.2f} ms",
                      flush=True)


if __name__ == "__main__":
    main()
