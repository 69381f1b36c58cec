"""`python -m loadtest ...`: drive the engine (gRPC) or the proxy (OpenAI HTTP) and report latencies."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import sys
import time

from loadtest.backends import GrpcBackend, OpenAIBackend
from loadtest.report import format_summary, parse_slos, record_dict, summarize
from loadtest.runner import run_load
from loadtest.workload import LENGTH_DISTS, JsonlWorkload, LengthDist, RandomTokenWorkload

EXAMPLES = """examples:
  python -m loadtest --backend grpc --target localhost:50051 --concurrency 4 --num-requests 64
  python -m loadtest --backend openai --target http://localhost:8000 --request-rate 2 --burstiness 0.5 \\
      --input-len 256 --input-dist uniform --input-spread 0.5 --max-tokens 64 --ignore-eos \\
      --goodput ttft:1000 tpot:100 --output-dir results/run1
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("target")
    t.add_argument("--backend", choices=("grpc", "openai"), default="openai",
                   help="grpc: the engine's Generate RPC; openai: the proxy's streaming completions (default)")
    t.add_argument("--target", default=None,
                   help="host:port of the engine, or the proxy's base URL (default localhost:50051 / "
                        "http://localhost:8000)")
    t.add_argument("--model", default=None, help="model name for the OpenAI API (default: the first served)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token for the proxy")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take before it fails")
    lo = p.add_argument_group("load")
    lo.add_argument("--num-requests", type=int, default=None, help="requests to send (default 100 without "
                                                                   "--duration)")
    lo.add_argument("--duration", type=float, default=None, help="stop issuing new requests after this many s")
    lo.add_argument("--request-rate", type=float, default=math.inf,
                    help="mean arrivals per second (default inf: all at once, limited by --max-concurrency)")
    lo.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps between arrivals: 1 = Poisson, <1 burstier, >1 steadier")
    lo.add_argument("--max-concurrency", "--concurrency", type=int, default=None, dest="max_concurrency",
                    help="most requests in flight; with the default rate inf this is a fixed concurrency")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                   help='prompts from JSONL lines {"prompt"|"prompt_token_ids"|"messages": ..., "max_tokens"?}; '
                        "default: random tokens")
    w.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens (random prompts)")
    w.add_argument("--input-dist", choices=LENGTH_DISTS, default="fixed")
    w.add_argument("--input-spread", type=float, default=0.0, help="uniform: +-fraction; normal: std / mean")
    w.add_argument("--max-tokens", "--output-len", type=int, default=128, dest="output_len",
                   help="mean max_tokens of a request")
    w.add_argument("--output-dist", choices=LENGTH_DISTS, default="fixed")
    w.add_argument("--output-spread", type=float, default=0.0)
    w.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (no early EOS)")
    w.add_argument("--token-range", default="1000:10000", metavar="LO:HI",
                   help="random prompt token ids are drawn from [LO, HI)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    o = p.add_argument_group("results")
    o.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)")
    o.add_argument("--output-dir", default=None, help="write results.json, latency_cdf.png and throughput.png here")
    o.add_argument("--label", default="", help="a name for this run, kept in the results and plot titles")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    return p


def make_backend(args: argparse.Namespace):
    if args.backend == "grpc":
        return GrpcBackend(args.target or "localhost:50051", timeout=args.timeout, temperature=args.temperature)
    return OpenAIBackend(args.target or "http://localhost:8000", model=args.model, api_key=args.api_key,
                         timeout=args.timeout, temperature=args.temperature)


def make_workload(args: argparse.Namespace):
    output_len = LengthDist(args.output_len, args.output_dist, args.output_spread)
    if args.dataset:
        return JsonlWorkload(args.dataset, output_len, ignore_eos=args.ignore_eos, seed=args.seed)
    lo, _, hi = args.token_range.partition(":")
    return RandomTokenWorkload(LengthDist(args.input_len, args.input_dist, args.input_spread), output_len,
                               ignore_eos=args.ignore_eos, token_range=(int(lo), int(hi)), seed=args.seed)


async def run(args: argparse.Namespace) -> dict:
    backend = make_backend(args)
    workload = make_workload(args)
    slos = parse_slos(args.goodput)
    try:
        try:
            model = await backend.open()
        except Exception as e:  # noqa: BLE001 - any failure to reach the target ends the run here
            raise SystemExit(f"loadtest: cannot reach {args.backend} target: {type(e).__name__}: {e}") from None
        result = await run_load(backend.send, workload, num_requests=args.num_requests, duration=args.duration,
                                request_rate=args.request_rate, burstiness=args.burstiness,
                                max_concurrency=args.max_concurrency, seed=args.seed,
                                progress=not args.no_progress)
    finally:
        await backend.close()
    summary = summarize(result.records, result.duration, slos)
    config = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
              if k != "api_key"}
    results = {"label": args.label, "model": model, "backend": backend.name, "config": config,
               "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
               "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               # The run's start on the wall clock: runs of several client processes can be put on one timeline.
               "start_unix_s": time.time() - (time.perf_counter() - result.start), "summary": summary,
               "requests": [record_dict(r, result.start) for r in result.records]}
    print(format_summary(summary, f" {args.label or 'Load Test Result'} "))
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        if not args.no_plots:
            from loadtest.plots import write_plots

            paths = write_plots(result.records, result.start, args.output_dir, args.label)
            if not paths:
                print("matplotlib is not installed: no plots (pip install '.[loadtest]')", file=sys.stderr)
        print(f"results in {args.output_dir}/", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_requests is None and args.duration is None:
        args.num_requests = 100
    try:
        make_workload(args)
        parse_slos(args.goodput)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    results = asyncio.run(run(args))
    return 0 if results["summary"]["successful_requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
