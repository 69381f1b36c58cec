"""Where a served workload's host time goes: py-spy on every serving process (the gRPC front end and the
engine core) while `python -m loadtest` drives the engine (issue 17).

    python bench/served_profile.py --out DIR [--input-len 4096 --max-tokens 1 --num-requests 16 \
        --concurrency 1] -- --model bench/configs/llama-3-8b --load-format dummy --device cuda ...

Everything after `--` is `inference-service serve`'s flags. Writes DIR/engine.log, DIR/loadtest/, one
collapsed-stack file a process (DIR/pid<N>_<role>.txt: py-spy `--format raw`, idle frames included, so
waits show as well as work) and DIR/summary.md: per process, the frames with the most samples of their
own and the most samples under them. Needs py-spy on PATH (`pip install py-spy`; on the GPU machine a
carried wheel).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from served_path import loadtest  # noqa: E402

from inference_service.metrics import _PREFIX  # noqa: E402
from tests.grpc_client import start_engine  # noqa: E402

TOP = 25
# The engine's latency histograms whose means split a request's time: arrival (front end) -> first
# scheduling (core) -> first token, and the steps themselves.
HISTOGRAMS = ("request_queue_time_seconds", "request_prefill_time_seconds", "time_to_first_token_seconds",
              "step_duration_seconds")


def histogram_totals(metrics_port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of HISTOGRAMS, from the engine's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    totals = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name in HISTOGRAMS:  # ours only (vLLM's twins count the same requests again)
                if sample.name in (_PREFIX + name + "_sum", _PREFIX + name + "_count"):
                    total = totals.setdefault(name, [0.0, 0.0])
                    total[0 if sample.name.endswith("_sum") else 1] += sample.value
    return {name: tuple(v) for name, v in totals.items()}


def summarize(path: str) -> tuple[list, list, int]:
    """Top frames of a collapsed-stack file: (by own samples, by samples under them, total samples)."""
    own, under, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            total += int(count)
            own[frames[-1]] += int(count)
            for frame in set(frames):
                under[frame] += int(count)
    return own.most_common(TOP), under.most_common(TOP), total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--input-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples a second")
    parser.add_argument("serve_flags", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    flags = args.serve_flags[1:] if args.serve_flags[:1] == ["--"] else args.serve_flags
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        sys.exit("py-spy is not on PATH (pip install py-spy)")
    os.makedirs(args.out, exist_ok=True)
    engine = start_engine(*flags, log_path=os.path.join(args.out, "engine.log"), timeout_s=600)
    recorders = []
    try:
        lens = (args.input_len, args.max_tokens)
        # NOTE: a seed of its own: the profiled run's first prompts would otherwise be the warm-up's, prefix-cache
        # hits in the histograms' means
        loadtest("grpc", engine.target, os.path.join(args.out, "warmup"), num_requests=4, lens=lens,
                 concurrency=args.concurrency, seed=1)
        front_end = psutil.Process(engine.process.pid)
        processes = [(front_end.pid, "front_end")] + [(child.pid, "child") for child in front_end.children(True)
                                                       if "python" in child.name()]
        for pid, role in processes:
            path = os.path.join(args.out, f"pid{pid}_{role}.txt")
            recorders.append((subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", str(args.rate),
                                                "--format", "raw", "--idle", "--nonblocking", "--output", path],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path, role))
        before = histogram_totals(engine.metrics_port)
        loadtest("grpc", engine.target, os.path.join(args.out, "loadtest"), num_requests=args.num_requests, lens=lens,
                 concurrency=args.concurrency)
        after = histogram_totals(engine.metrics_port)
    finally:
        for recorder, _, _ in recorders:
            recorder.send_signal(2)  # SIGINT: py-spy writes its file and exits
            recorder.wait(60)
        engine.stop()
    title = (f"# py-spy of the serving processes: {args.num_requests} requests of {args.input_len} tokens in, "
             f"{args.max_tokens} out, {args.concurrency} at a time")
    lines = [title, "", f"serve flags: `{' '.join(flags)}`", "",
             "| engine histogram (during the profiled run) | mean ms | count |", "|---|---:|---:|"]
    for name in HISTOGRAMS:
        (sum0, count0), (sum1, count1) = before.get(name, (0, 0)), after.get(name, (0, 0))
        if count1 > count0:
            lines.append(f"| {name} | {(sum1 - sum0) / (count1 - count0) * 1e3:.2f} | {count1 - count0:.0f} |")
    lines.append("")
    for _, path, role in recorders:
        if not os.path.exists(path):
            lines += [f"## {os.path.basename(path)}: no samples written", ""]
            continue
        own, under, total = summarize(path)
        lines += [f"## {os.path.basename(path)} ({role}, {total} samples)", "", "| own samples | frame |", "|---:|---|"]
        lines += [f"| {count} | `{frame[:150]}` |" for frame, count in own]
        lines += ["", "| samples under | frame |", "|---:|---|"]
        lines += [f"| {count} | `{frame[:150]}` |" for frame, count in under]
        lines.append("")
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
