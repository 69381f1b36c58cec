"""What a user gets through the API against what the engine does in-process: issue 17's "Done when" in one command.

One engine configuration (the same `inference-service serve` flags for all three paths), one workload:

  in_process  the engine built in a child process from those flags (`configs_from_args`), every request added
              at once, `step()` until done: output tok/s; batch-1 step time (128 in, 512 out)
  grpc        `inference-service serve <flags>`, driven by `python -m loadtest --backend grpc`
  rest        `rest-proxy serve --workers N` in front of it, `python -m loadtest --backend openai` (streaming
              completions)
  plus, served: batch-1 TPOT over gRPC and HTTP, and TTFT of a 1k and a 4k prompt (best of 4, one at a time)
  against the FLOP roofline (`gpu_common.ttft_roofline_ms`, at the measured matmul rate).

Each TTFT prompt comes after `ttft_rest_s` of idle GPU, as the matmul rate is measured (a burst; back to back a
Hopper runs at its power cap: that TTFT and a 1 s product's rate are reported beside), after the warm-up and batch
1 but before the load on both paths (one GPU state), timed from the request's checks on.

Results: DIR/served_path.json and DIR/served_path.md (device, date, commit; served numbers first, each with its
ratio to in-process and to the roofline, and the issue's targets), the loadtest runs under DIR/<path>/.

  python bench/served_path.py --out results/served            # H100: 384 x (1000 in, 1000 out), fp8 KV,
                                                              # Llama-3-8B dummy weights, bf16 (~6-8 min)
  python bench/served_path.py --smoke --out /tmp/served       # this CPU, the embedded SmolLM2 (~1-2 min)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

# The workload on an H100, and a CPU smoke of the same steps.
GPU = {"model": os.path.join(ROOT, "bench", "configs", "llama-3-8b"), "requests": 384, "lens": (1000, 1000),
       "max_num_seqs": 384, "serve": ["--load-format", "dummy", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8",
                                      "--device", "cuda"],
       "batch1": (128, 512), "ttft_lens": (1024, 4096), "matmul_n": 8192, "ttft_rest_s": 1.0}
SMOKE = {"model": None, "requests": 8, "lens": (32, 16), "max_num_seqs": 8,
         "serve": ["--device", "cpu", "--kv-cache-memory", "256"], "batch1": (16, 16), "ttft_lens": (128, 256),
         "matmul_n": 512, "ttft_rest_s": 0.0}
TARGETS = {"grpc_ratio": 0.95, "grpc_tok_s": 10500, "rest_ratio": 0.92, "batch1_tpot_ratio": 1.03,
           "ttft_1k_roofline": 1.3, "ttft_4k_roofline": 1.1}


def serve_flags(setup: dict) -> list[str]:
    """The engine flags every path runs with (the served engine's command line, the in-process engine's config)."""
    model = ["--model", setup["model"]] if setup["model"] else []
    return [*model, *setup["serve"], "--max-num-seqs", str(setup["max_num_seqs"])]


# --------------------------------------------------------------------------------------------- in-process

def in_process(flags: list[str], setup: dict, out_path: str) -> None:
    """Runs in a child process (so the served engine later gets the whole device): the offline workload,
    batch-1 step time, and the FLOP roofline of the TTFT prompts."""
    import gpu_common as common
    import torch
    from prometheus_client import CollectorRegistry

    from inference_service.cli import build_parser, configs_from_args
    from inference_service.engine.gc_heap import freeze_startup_heap
    from inference_service.engine.llm_engine import LLMEngine
    from inference_service.engine.sampling_params import SamplingParams
    from inference_service.metrics import EngineMetrics

    config, _ = configs_from_args(build_parser().parse_args(["serve", *flags]))
    engine = LLMEngine(config, metrics=EngineMetrics("bench", registry=CollectorRegistry()))
    freeze_startup_heap()  # as `serve` does
    common.DEVICE = "cpu" if engine.device.type == "cpu" else "cuda"
    result: dict = {"device": torch.cuda.get_device_name() if common.DEVICE == "cuda" else "cpu",
                    "cuda_graph_batch_size": config.cuda_graph_batch_size if common.DEVICE == "cuda" else None}
    # The same warm-up as the served runs get: 4 requests of 64 tokens, 8 out
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.generate([_prompt(64, 7 + i, engine) for i in range(4)], warm)

    # Batch 1: the median step while one sequence decodes
    prompt_len, new_tokens = setup["batch1"]
    engine.add_request(engine.input_processor.process(
        "b1", _prompt(prompt_len, 1, engine), SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)))
    stamps = []
    while engine.has_unfinished:
        engine.step()
        stamps.append(time.perf_counter())
    steps = sorted((b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:]))
    result["batch1_step_ms"] = round(steps[len(steps) // 2], 3)

    # Time to first token in process with the same flags (the KV cache dtype included): the served TTFTs'
    # own baseline, so a gap between them is the serving path's and the rest the engine's.
    result["ttft_ms"] = _ttft_ms(engine, setup, seed=50, rest_s=setup["ttft_rest_s"])
    result["ttft_ms_back_to_back"] = _ttft_ms(engine, setup, seed=55, rest_s=0.0)

    # The offline workload: every request at once
    prompt_len, output_len = setup["lens"]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(setup["requests"]):
        engine.add_request(engine.input_processor.process(f"o{i}", _prompt(prompt_len, 1000 + i, engine), params))
    t0, num_out = time.perf_counter(), 0
    while engine.has_unfinished:
        num_out += sum(len(d.token_ids) for d in engine.step())
    elapsed = time.perf_counter() - t0
    result["offline"] = {"output_tokens": num_out, "elapsed_s": round(elapsed, 2), "output_tok_s": round(num_out / elapsed, 1),
                         "preemptions": engine.scheduler.num_preemptions}
    # Again after the load: what the engine's and the GPU's state after a load costs
    result["ttft_ms_after_load"] = _ttft_ms(engine, setup, seed=60, rest_s=setup["ttft_rest_s"])

    lens = setup["ttft_lens"]
    time.sleep(setup["ttft_rest_s"] * 2)  # the burst rate of a rested GPU, as the TTFTs above were measured
    tflops = common.matmul_tflops(setup["matmul_n"], engine.loaded.model.dtype)
    result["matmul_tflops"] = round(tflops, 2)
    if common.DEVICE == "cuda":
        result["matmul_tflops_sustained_1s"] = round(
            common.sustained_matmul_tflops(setup["matmul_n"], engine.loaded.model.dtype, 1.0), 2)
    result["ttft_roofline_ms"] = {str(n): round(common.ttft_roofline_ms(engine, n, tflops), 3) for n in lens}
    with open(out_path, "w") as f:
        json.dump(result, f)


def _ttft_ms(engine, setup: dict, seed: int, rest_s: float) -> dict:
    """Best of 4 in-process TTFTs (ms) a prompt length, fresh prompts (no prefix-cache hits), each after `rest_s`
    of idle GPU."""
    import gpu_common as common

    from inference_service.engine.sampling_params import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    best = {}
    for n in setup["ttft_lens"]:
        times = []
        for rep in range(4):
            # NOTE: a seed of its own a length: prompts drawn from one seed share their first tokens, and the
            # longer prompt would hit the prefix cache on the shorter one's blocks
            prompt_seed = seed * 100_000 + n + rep
            prompt = _prompt(n, prompt_seed, engine)
            common.sync()
            time.sleep(rest_s)
            t0 = time.perf_counter()  # from the request's checks on, as a served request's arrival
            engine.add_request(engine.input_processor.process(f"t{n}-{prompt_seed}", prompt, one))
            engine.run_until_idle()
            times.append(time.perf_counter() - t0)
        best[str(n)] = round(min(times) * 1e3, 2)
    return best


def _prompt(n: int, seed: int, engine) -> list[int]:
    import torch

    vocab = min(engine.loaded.config.vocab_size, 128000)
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------------------------- served

def loadtest(backend: str, target: str, out_dir: str, *, num_requests: int, lens: tuple[int, int],
             concurrency: int | None = None, seed: int = 0, gap_s: float = 0.0) -> dict:
    """One `python -m loadtest` run; its summary, plus `min_ttft_ms`. `gap_s`: requests that far apart, else at once."""
    cmd = [sys.executable, "-m", "loadtest", "--backend", backend, "--target", target, "--num-requests",
           str(num_requests), "--input-len", str(lens[0]), "--max-tokens", str(lens[1]), "--ignore-eos",
           "--seed", str(seed), "--no-plots", "--no-progress", "--output-dir", out_dir]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    cmd += ["--request-rate", str(1 / gap_s), "--burstiness", "1000"] if gap_s else []
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "results.json")) as f:
        results = json.load(f)
    summary = results["summary"]
    summary["min_ttft_ms"] = min(r["ttft_s"] for r in results["requests"] if r["ok"]) * 1e3
    if summary["failed_requests"]:
        raise RuntimeError(f"{backend} run in {out_dir}: {summary['errors_by_kind']}")
    return summary


def served(backend: str, target: str, out: str, setup: dict, num_clients: int) -> dict:
    """The offline workload all at once, batch-1 TPOT and TTFTs through one front end. Every run has prompts of
    its own (seeds by backend and run): a prompt seen before would be served from the prefix cache."""
    seed = {"grpc": 10_000, "openai": 20_000}[backend]
    loadtest(backend, target, os.path.join(out, backend, "warmup"), num_requests=4, lens=(64, 8), seed=seed)
    # The in-process run's order (the module's docstring)
    batch1 = loadtest(backend, target, os.path.join(out, backend, "batch1"), num_requests=3, lens=setup["batch1"],
                      concurrency=1, seed=seed + 200)
    result = {"batch1_tpot_ms": batch1["tpot_ms"]["p50"], "ttft_ms": {}}
    for n in setup["ttft_lens"]:
        # max_tokens 1: best of 4, one at a time on one connection (the first compiles the shapes), each after the
        # GPU rested (the module's docstring): a request every rest + 0.25 s
        time.sleep(setup["ttft_rest_s"])
        summary = loadtest(backend, target, os.path.join(out, backend, f"ttft{n}"), num_requests=4, lens=(n, 1),
                           concurrency=1, seed=seed + n,
                           gap_s=setup["ttft_rest_s"] + 0.25 if setup["ttft_rest_s"] else 0.0)
        result["ttft_ms"][str(n)] = round(summary["min_ttft_ms"], 2)
    full = parallel_loadtest(backend, target, os.path.join(out, backend, "load"), setup, num_clients, seed + 100)
    return {**full, **result}


def parallel_loadtest(backend: str, target: str, out_dir: str, setup: dict, num_clients: int, seed: int) -> dict:
    """The throughput run from `num_clients` loadtest processes at once (so one client's event loop does not
    cap what a front end can stream), each with its own prompts; on one wall-clock timeline: output tokens
    over first request sent to last stream ended."""
    counts = [setup["requests"] // num_clients + (i < setup["requests"] % num_clients) for i in range(num_clients)]
    cmds = []
    for i, count in enumerate(counts):
        client_dir = os.path.join(out_dir, f"client{i}")
        cmds.append((client_dir, [sys.executable, "-m", "loadtest", "--backend", backend, "--target", target,
                                  "--num-requests", str(count), "--input-len", str(setup["lens"][0]), "--max-tokens",
                                  str(setup["lens"][1]), "--ignore-eos", "--seed", str(seed + i), "--no-plots",
                                  "--no-progress", "--output-dir", client_dir]))
    processes = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL) for _, cmd in cmds]
    if any(p.wait() != 0 for p in processes):
        raise RuntimeError(f"a loadtest client failed: see {out_dir}")
    starts, ends, num_out, tpots, ttfts = [], [], 0, [], []
    for client_dir, _ in cmds:
        with open(os.path.join(client_dir, "results.json")) as f:
            run = json.load(f)
        if run["summary"]["failed_requests"]:
            raise RuntimeError(f"{backend} run in {client_dir}: {run['summary']['errors_by_kind']}")
        for r in run["requests"]:
            starts.append(run["start_unix_s"] + r["start_s"])
            ends.append(run["start_unix_s"] + r["start_s"] + r["e2el_s"])
            num_out += r["output_tokens"]
            tpots += [r["tpot_s"]] if r["tpot_s"] is not None else []
            ttfts.append(r["ttft_s"])
    span = max(ends) - min(starts)
    return {"output_tok_s": round(num_out / span, 1), "output_tokens": num_out, "span_s": round(span, 2),
            "mean_tpot_ms": round(sum(tpots) / len(tpots) * 1e3, 2), "mean_ttft_ms": round(sum(ttfts) / len(ttfts) * 1e3, 1),
            "num_clients": num_clients}


def start_proxy(engine_target: str, workers: int, log_path: str) -> tuple[subprocess.Popen, str]:
    from tests.grpc_client import free_port  # NOTE: here, not at the top: gpu_decode_profile imports this module
    # where grpc-health-checking is not installed

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "rest_proxy.cli", "serve", "--engine", engine_target,
                                "--port", str(port), "--workers", str(workers), "--log-level", "warning"],
                               stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"proxy exited with {process.returncode}: see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"proxy not healthy after 120 s: see {log_path}")


# ---------------------------------------------------------------------------------------------- report

def ratios(results: dict) -> dict:
    inp = results["in_process"]
    base, step = inp["offline"]["output_tok_s"], inp["batch1_step_ms"]
    out = {}
    for path in ("grpc", "rest"):
        s = results[path]
        out[path] = {"to_in_process": round(s["output_tok_s"] / base, 3),
                     "batch1_tpot_to_step": round(s["batch1_tpot_ms"] / step, 3),
                     "ttft_to_roofline": {n: round(s["ttft_ms"][n] / inp["ttft_roofline_ms"][n], 2)
                                          for n in s["ttft_ms"]}}
    out["in_process"] = {"ttft_to_roofline": {n: round(t / inp["ttft_roofline_ms"][n], 2)
                                              for n, t in inp["ttft_ms"].items()}}
    return out


def checks(results: dict, r: dict, setup: dict) -> dict:
    n1k, n4k = (str(n) for n in setup["ttft_lens"])
    return {
        f"grpc >= {TARGETS['grpc_ratio']} x in-process": r["grpc"]["to_in_process"] >= TARGETS["grpc_ratio"],
        f"grpc >= {TARGETS['grpc_tok_s']} tok/s": results["grpc"]["output_tok_s"] >= TARGETS["grpc_tok_s"],
        f"rest >= {TARGETS['rest_ratio']} x in-process": r["rest"]["to_in_process"] >= TARGETS["rest_ratio"],
        f"batch-1 TPOT <= {TARGETS['batch1_tpot_ratio']} x step (grpc and rest)": all(
            r[p]["batch1_tpot_to_step"] <= TARGETS["batch1_tpot_ratio"] for p in ("grpc", "rest")),
        f"TTFT {n1k} <= {TARGETS['ttft_1k_roofline']} x roofline (grpc)":
            r["grpc"]["ttft_to_roofline"][n1k] <= TARGETS["ttft_1k_roofline"],
        f"TTFT {n4k} <= {TARGETS['ttft_4k_roofline']} x roofline (grpc)":
            r["grpc"]["ttft_to_roofline"][n4k] <= TARGETS["ttft_4k_roofline"],
    }


def markdown(results: dict) -> str:
    inp, r, setup = results["in_process"], results["ratios"], results["setup"]
    n_in, n_out = setup["lens"]
    b_in, b_out = setup["batch1"]
    lines = [f"# Served path vs in-process: {results['device']}, {results['date']}, commit {results['commit']}", "",
             f"{setup['requests']} requests x ({n_in} in, {n_out} out), all at once, ignore_eos; engine flags: "
             f"`{' '.join(results['serve_flags'])}`; proxy `--workers {results['proxy_workers']}`; "
             f"{results['load_clients']} loadtest client processes.", "",
             "| path | output tok/s | ratio to in-process | mean TPOT ms | batch-1 TPOT ms (ratio to step) |",
             "|---|---:|---:|---:|---:|"]
    for path, name in (("grpc", "served, gRPC (loadtest --backend grpc)"),
                       ("rest", "served, REST proxy streaming (loadtest --backend openai)")):
        s = results[path]
        lines.append(f"| {name} | {s['output_tok_s']:,.0f} | {r[path]['to_in_process']:.2f} | "
                     f"{s['mean_tpot_ms']:.1f} | {s['batch1_tpot_ms']:.2f} ({r[path]['batch1_tpot_to_step']:.2f}) |")
    lines.append(f"| in-process engine | {inp['offline']['output_tok_s']:,.0f} | 1.00 | | "
                 f"{inp['batch1_step_ms']:.2f} (step, {b_in} in, {b_out} out) |")
    sustained = inp.get("matmul_tflops_sustained_1s")
    lines += ["", f"Time to first token (best of 4, one at a time, each after {setup['ttft_rest_s']:g} s of idle GPU) "
                  f"against the FLOP roofline at {inp['matmul_tflops']} TFLOP/s (a burst of products; "
                  f"{sustained or 'n/a'} TFLOP/s held for 1 s):", "",
              "| prompt | roofline ms | in-process ms (ratio) | in-process back to back ms | in-process after the "
              "load ms | gRPC ms (ratio) | REST ms (ratio) |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for n, roof in inp["ttft_roofline_ms"].items():
        lines.append(f"| {n} | {roof:.1f} | {inp['ttft_ms'][n]:.1f} ({r['in_process']['ttft_to_roofline'][n]:.2f}) "
                     f"| {inp.get('ttft_ms_back_to_back', {}).get(n, float('nan')):.1f} "
                     f"| {inp.get('ttft_ms_after_load', {}).get(n, float('nan')):.1f} "
                     f"| {results['grpc']['ttft_ms'][n]:.1f} "
                     f"({r['grpc']['ttft_to_roofline'][n]:.2f}) | {results['rest']['ttft_ms'][n]:.1f} "
                     f"({r['rest']['ttft_to_roofline'][n]:.2f}) |")
    lines += ["", "Targets (issue 17):", ""] + [f"- [{'x' if ok else ' '}] {name}" for name, ok in
                                                results["checks"].items()]
    return "\n".join(lines) + "\n"


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for served_path.json, served_path.md and the runs")
    parser.add_argument("--smoke", action="store_true", help="this CPU, the embedded model, a tiny workload")
    parser.add_argument("--requests", type=int, default=None, help="requests of the throughput runs")
    parser.add_argument("--proxy-workers", type=int, default=None,
                        help="rest-proxy --workers (default: the proxy's own default)")
    parser.add_argument("--load-clients", type=int, default=None,
                        help="loadtest processes sharing the throughput runs (default: 4 on the GPU, 1 in --smoke)")
    parser.add_argument("--in-process-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    setup = dict(SMOKE if args.smoke else GPU)
    if args.requests:
        setup["requests"] = args.requests
    flags = serve_flags(setup)
    if args.in_process_child:
        in_process(flags, setup, args.in_process_child)
        return 0

    from rest_proxy.workers import default_num_workers

    os.makedirs(args.out, exist_ok=True)
    commit = os.environ.get("COMMIT") or _git_commit()
    workers = args.proxy_workers or default_num_workers()
    num_clients = args.load_clients or (1 if args.smoke else 4)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
                     "setup": setup, "serve_flags": flags, "proxy_workers": workers, "load_clients": num_clients, "seconds": {}}
    t0 = time.perf_counter()
    child_json = os.path.join(args.out, "in_process.json")
    child = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--in-process-child", child_json]
    subprocess.run(child + (["--smoke"] if args.smoke else []) +
                   (["--requests", str(args.requests)] if args.requests else []), cwd=ROOT, check=True)
    with open(child_json) as f:
        results["in_process"] = json.load(f)
    results["device"] = results["in_process"]["device"]
    results["seconds"]["in_process"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    from tests.grpc_client import start_engine

    engine = start_engine(*flags, log_path=os.path.join(args.out, "engine.log"), timeout_s=600)
    proxy = None
    try:
        results["seconds"]["engine_start"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        results["grpc"] = served("grpc", engine.target, args.out, setup, num_clients)
        results["seconds"]["grpc"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        proxy, url = start_proxy(engine.target, workers, os.path.join(args.out, "proxy.log"))
        results["rest"] = served("openai", url, args.out, setup, num_clients)
        results["seconds"]["rest"] = round(time.perf_counter() - t0, 1)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(60)
        engine.stop()
    results["ratios"] = ratios(results)
    results["checks"] = checks(results, results["ratios"], setup)
    with open(os.path.join(args.out, "served_path.json"), "w") as f:
        json.dump(results, f, indent=1)
    report = markdown(results)
    with open(os.path.join(args.out, "served_path.md"), "w") as f:
        f.write(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
