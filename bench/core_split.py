"""The engine core in its own process against the in-process engine, on the embedded model, through gRPC.

Alternates `serve --engine-core-process` (the split, the GPU default) and `serve --engine-in-process` (the CPU
default) ROUNDS times, each
measured as bench/decode_throughput.py measures ours: batch-1 greedy decode over its prompts, and
CONCURRENCY requests at once. Prints each round and the medians.

Usage: python bench/core_split.py [--rounds 2] [--new-tokens 48] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

from decode_throughput import measure_engine, prompt_ids

from inference_service.model.loader import load_model

MODES = {"split (the GPU default)": ["--engine-core-process"], "in-process (the CPU default)": ["--engine-in-process"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    prompts = prompt_ids(load_model(None).tokenizer)
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        for mode, flags in MODES.items():
            result = measure_engine(flags, prompts, args.new_tokens, args.concurrency)
            rows[mode].append(result)
            print(f"round {round_index + 1} {mode:16s} batch 1: {result['batch1']['tok_s']:6.1f} tok/s, "
                  f"TTFT {result['batch1']['ttft_ms']:6.1f} ms; {args.concurrency} concurrent: "
                  f"{result['concurrent']['tok_s']:6.1f} tok/s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"\n{datetime.date.today()} at {commit}, {os.cpu_count()} CPUs, medians of {args.rounds} rounds\n")
    print(f"| engine | batch-1 decode tok/s | batch-1 TTFT ms | {args.concurrency} concurrent tok/s |")
    print("|---|---:|---:|---:|")
    for mode, results in rows.items():
        b1 = statistics.median(r["batch1"]["tok_s"] for r in results)
        ttft = statistics.median(r["batch1"]["ttft_ms"] for r in results)
        bn = statistics.median(r["concurrent"]["tok_s"] for r in results)
        print(f"| {mode} | {b1:.1f} | {ttft:.1f} | {bn:.1f} |")


if __name__ == "__main__":
    main()
