"""Soak test (not in CI): moderate load through the proxy for a long time; memory and KV blocks must not grow.

    python bench/soak.py                        # starts its own engine + proxy, 10 minutes
    python bench/soak.py --minutes 2 --proxy http://localhost:8000 --engine localhost:50051 \\
        --engine-metrics http://localhost:9090/metrics --engine-pid 1234 --proxy-pid 1235

The run is cut into windows. In each, requests arrive as a Poisson process through the proxy; at
the end of a window the in-flight requests finish, and then (idle) the script records RSS of both
processes and the KV blocks still in use, plus the window's latency percentiles and peak blocks.
Pass: every idle sample has 0 blocks in use and RSS after the first window grows by less than
--max-rss-growth. Writes soak.json and soak.png to --output-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from inference_service.api import pb, pb_grpc  # noqa: E402
from loadtest.backends import OpenAIBackend  # noqa: E402
from loadtest.report import summarize  # noqa: E402
from loadtest.runner import run_load  # noqa: E402
from loadtest.workload import LengthDist, RandomTokenWorkload  # noqa: E402
from tests.grpc_client import free_port, start_engine  # noqa: E402


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def kv_usage(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("inference_engine_kv_cache_usage_ratio{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("inference_engine_kv_cache_usage_ratio missing")


class PeakSampler(threading.Thread):
    """Samples KV usage every second while load runs; keeps the peak."""

    def __init__(self, metrics_url: str):
        super().__init__(daemon=True)
        self.metrics_url, self.peak, self.stop = metrics_url, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.peak = max(self.peak, kv_usage(self.metrics_url))


def start_stack(args) -> tuple[list[subprocess.Popen], str, str, str, int, int]:
    os.makedirs(args.output_dir, exist_ok=True)
    engine = start_engine("--max-model-len", "2048", log_path=os.path.join(args.output_dir, "engine.log"))
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "rest_proxy.cli", "serve", "--engine", engine.target,
                              "--port", str(port), "--log-level", "warning"], cwd=REPO,
                             stdout=open(os.path.join(args.output_dir, "proxy.log"), "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    return ([engine.process, proxy], engine.target, url, f"http://127.0.0.1:{engine.metrics_port}/metrics",
            engine.process.pid, proxy.pid)


def num_blocks(engine_target: str) -> int:
    with grpc.insecure_channel(engine_target) as ch:
        return pb_grpc.InferenceServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).kv_cache.num_blocks


async def soak(args, proxy_url: str, metrics_url: str, engine_pid: int, proxy_pid: int, blocks: int) -> list[dict]:
    workload = RandomTokenWorkload(LengthDist(args.input_len, "uniform", 0.5),
                                   LengthDist(args.max_tokens, "uniform", 0.5), seed=args.seed)
    backend = OpenAIBackend(proxy_url, timeout=120)
    await backend.open()
    windows = []
    t_start = time.monotonic()
    try:
        for w in range(max(1, round(args.minutes * 60 / args.window))):
            sampler = PeakSampler(metrics_url)
            sampler.start()
            offset = w * 1_000_000  # fresh prompts each window (no prefix-cache luck)
            result = await run_load(backend.send, lambda i: workload(offset + i), num_requests=None,
                                    duration=args.window, request_rate=args.request_rate,
                                    max_concurrency=args.max_concurrency, seed=args.seed + w, progress=False)
            sampler.stop.set()
            await asyncio.sleep(0.5)  # the engine publishes the post-finish state after its step
            s = summarize(result.records, result.duration)
            row = {"window": w, "t_end_s": round(time.monotonic() - t_start, 1),
                   "requests": s["num_requests"], "errors": s["errors_by_kind"],
                   "engine_rss_mib": round(rss_mib(engine_pid), 1), "proxy_rss_mib": round(rss_mib(proxy_pid), 1),
                   "idle_blocks_in_use": round(kv_usage(metrics_url) * blocks),
                   "peak_blocks_in_use": round(sampler.peak * blocks),
                   "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
                   "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
                   "e2el_p50_ms": s["e2el_ms"]["p50"], "e2el_p99_ms": s["e2el_ms"]["p99"],
                   "output_tok_s": round(s["output_token_throughput"], 1)}
            windows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        await backend.close()
    return windows


def plot(windows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [w["t_end_s"] / 60 for w in windows]
    fig, (a, b, c) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    a.plot(t, [w["engine_rss_mib"] for w in windows], "o-", label="engine RSS")
    a.plot(t, [w["proxy_rss_mib"] for w in windows], "o-", label="proxy RSS")
    a.set_ylabel("MiB")
    b.plot(t, [w["peak_blocks_in_use"] for w in windows], "o-", label="peak blocks in use (under load)")
    b.plot(t, [w["idle_blocks_in_use"] for w in windows], "o-", label="blocks in use when idle")
    b.set_ylabel("KV blocks")
    for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
        c.plot(t, [w[key] for w in windows], "o-", label=key.replace("_ms", ""))
    c.set_ylabel("ms")
    c.set_yscale("log")
    c.set_xlabel("minutes")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle("Soak: memory, KV blocks and latency per window")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--window", type=float, default=60, help="seconds per measurement window")
    p.add_argument("--request-rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth", type=float, default=0.10, help="allowed RSS growth after the first window")
    p.add_argument("--proxy", default=None, help="use this running proxy instead of starting a stack")
    p.add_argument("--engine", default=None, help="its engine's gRPC target (for the block count)")
    p.add_argument("--engine-metrics", default=None, help="its engine's /metrics URL")
    p.add_argument("--engine-pid", type=int, default=None)
    p.add_argument("--proxy-pid", type=int, default=None)
    p.add_argument("--output-dir", default=os.path.join(REPO, "bench", "results", "soak"))
    args = p.parse_args()
    os.makedirs(args.output_dir, exist_ok=True)
    procs: list[subprocess.Popen] = []
    if args.proxy:
        engine, proxy_url, metrics_url = args.engine, args.proxy, args.engine_metrics
        engine_pid, proxy_pid = args.engine_pid, args.proxy_pid
    else:
        procs, engine, proxy_url, metrics_url, engine_pid, proxy_pid = start_stack(args)
    try:
        windows = asyncio.run(soak(args, proxy_url, metrics_url, engine_pid, proxy_pid, num_blocks(engine)))
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(60)
    first, last = windows[0], windows[-1]
    growth = {k: (last[k] - first[k]) / first[k] for k in ("engine_rss_mib", "proxy_rss_mib")}
    ok = all(w["idle_blocks_in_use"] == 0 for w in windows) and all(g <= args.max_rss_growth for g in growth.values())
    verdict = {"pass": ok, "rss_growth_after_first_window": growth, "windows": windows, "config": vars(args)}
    with open(os.path.join(args.output_dir, "soak.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    try:
        plot(windows, os.path.join(args.output_dir, "soak.png"))
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print(f"soak {'PASSED' if ok else 'FAILED'}: RSS growth {growth}, idle blocks "
          f"{[w['idle_blocks_in_use'] for w in windows]}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
