"""Tensor parallelism's "Done when" (issue 22): one command, each case in a fresh process.

    tp1_8b / tp2_8b   Llama-3-8B bf16, dummy weights, batch 1 decode tok/s at TP1 and TP2 (goal: TP2 >= 1.6x TP1)
    tp2_8b_nccl       the same TP2 with --disable-custom-all-reduce: every all-reduce through NCCL (and its tokens
                      beside tp2_8b's: the symmetric-memory sums must not change the greedy output)
    tp2_70b           Llama-3-70B bf16 TP2 batch 1 decode tok/s (goal >= 45) and the weight-bandwidth roofline
    allreduce         time of one decode step's all-reduces (2 a layer + the embedding's, [1, hidden] bf16): NCCL
                      and the engine's path, eager and replayed from a CUDA graph
    offline_70b       Llama-3-70B TP2, fp8 KV: N x (1000 in, 1000 out) tok/s and its ratio to the compute bound
    profile_tp1_8b / profile_tp2_8b (on demand, --only): rank 0's batch-1 decode steps under torch.profiler
    tp1_8b_int4 / tp2_8b_int4 (on demand): batch-1 decode with --quantization int4 (each rank quantizes its slices;
                      --smoke has tp2_8b_int8)

Usage: python bench/gpu_tp.py --out DIR [--only a,b] [--offline-requests 1000]
       python bench/gpu_tp.py --out DIR --only tp1_8b          (one GPU: TP1 only, the no-regression check)
       python bench/gpu_tp.py --smoke --out DIR                 (CPU, a tiny model on gloo: the script runs)
Results: DIR/gpu_tp.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))  # the repository: `python bench/gpu_tp.py` from anywhere, and its children
CONFIGS = os.path.join(BENCH, "configs")
H200_BYTES_PER_S = 4.8e12  # HBM3e peak
H200_BF16_FLOPS = 989e12  # dense
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
               "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
SECTIONS = ("tp1_8b", "tp2_8b", "tp2_8b_nccl", "tp2_70b", "allreduce", "offline_70b")  # profile_* on demand


def case_specs(smoke: bool, offline_requests: int) -> dict[str, dict]:
    if smoke:
        folder = tempfile.mkdtemp(prefix="tp_smoke_")
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(TINY_CONFIG, f)
        common = {"model": folder, "device": "cpu", "dtype": "float32", "new_tokens": 8}
        return {"tp1_8b": {**common, "tp": 1}, "tp2_8b": {**common, "tp": 2},
                "tp2_8b_nccl": {**common, "tp": 2, "custom_all_reduce": False}, "tp2_70b": {**common, "tp": 2},
                "tp2_8b_int8": {**common, "tp": 2, "quantization": "int8"},
                "allreduce": {**common, "tp": 2, "hidden": 128, "layers": 2},
                "offline_70b": {**common, "tp": 2, "requests": 4, "input": 16, "output": 16, "kv": "auto"}}
    llama8, llama70 = os.path.join(CONFIGS, "llama-3-8b"), os.path.join(CONFIGS, "llama-3-70b")
    common = {"device": "cuda", "dtype": "bfloat16", "new_tokens": 256}
    return {"tp1_8b": {**common, "model": llama8, "tp": 1}, "tp2_8b": {**common, "model": llama8, "tp": 2},
            "tp2_8b_nccl": {**common, "model": llama8, "tp": 2, "custom_all_reduce": False},
            "profile_tp1_8b": {**common, "model": llama8, "tp": 1}, "profile_tp2_8b": {**common, "model": llama8, "tp": 2},
            "tp1_8b_int4": {**common, "model": llama8, "tp": 1, "quantization": "int4"},
            "tp2_8b_int4": {**common, "model": llama8, "tp": 2, "quantization": "int4"},
            "tp2_70b": {**common, "model": llama70, "tp": 2},
            "allreduce": {**common, "model": llama70, "tp": 2, "hidden": 8192, "layers": 80},
            "offline_70b": {**common, "model": llama70, "tp": 2, "requests": offline_requests, "input": 1000,
                            "output": 1000, "kv": "fp8"}}


# ------------------------------------------------------------------------------------- one case, in a child

def _engine(spec: dict, kv_cache_dtype: str = "auto", max_num_seqs: int = 1):
    from prometheus_client import CollectorRegistry

    from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig
    from inference_service.engine.llm_engine import LLMEngine
    from inference_service.metrics import EngineMetrics

    config = EngineConfig(model=spec["model"], device=spec["device"], dtype=spec["dtype"], load_format="dummy",
                          tensor_parallel_size=spec["tp"],
                          disable_custom_all_reduce=not spec.get("custom_all_reduce", True),
                          quantization=spec.get("quantization"),
                          cache=CacheConfig(kv_cache_memory_mib=64 if spec["device"] == "cpu" else None,
                                            kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs))
    return LLMEngine(config, metrics=EngineMetrics("bench", registry=CollectorRegistry()))


def _stop(engine) -> None:
    workers = getattr(engine.loaded.model, "workers", None)
    if workers is not None:
        workers.stop(engine.loaded.model)


def run_decode(spec: dict) -> dict:
    """Batch 1: tok/s of the decode steps (a 1-token generation's time, the prefill, subtracted)."""
    from inference_service.engine.sampling_params import SamplingParams

    engine = _engine(spec)
    try:
        prompt = list(range(1, 17))
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        many = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
        engine.generate([prompt], many)  # warm-up
        t0 = time.perf_counter()
        engine.generate([prompt], first)
        t1 = time.perf_counter()
        out = engine.generate([prompt], many)
        t2 = time.perf_counter()
        decode_s = (t2 - t1) - (t1 - t0)
        num = len(out[0].completions[0].token_ids) - 1
        weight_bytes = engine.loaded.model.num_weight_bytes
        return {"tok_s": num / decode_s, "decode_tokens": num, "first_tokens": out[0].completions[0].token_ids[:32],
                "weight_bytes_per_rank": weight_bytes,
                "roofline_tok_s": H200_BYTES_PER_S / weight_bytes if spec["device"] == "cuda" else None}
    finally:
        _stop(engine)


def run_profile(spec: dict) -> dict:
    """Rank 0's decode steps at batch 1 under torch.profiler: wall time a step and GPU time by kernel (the
    replayed graphs' kernels; a collective's time includes its wait for the other rank)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from inference_service.engine.sampling_params import SamplingParams

    engine = _engine(spec)
    try:
        steps = 40
        params = SamplingParams(max_tokens=3 * steps, temperature=0.0, ignore_eos=True)
        engine.add_request(engine.input_processor.process("p", list(range(1, 17)), params))
        for _ in range(steps):  # prefill, graphs warm
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        kernels = {}
        for evt in prof.key_averages():
            device_us = getattr(evt, "self_device_time_total", 0)
            if device_us > 0:
                kernels[evt.key] = (device_us / steps, evt.count / steps)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:20]
        return {"step_wall_ms": wall_ms, "gpu_kernel_ms_per_step": sum(us for us, _ in kernels.values()) / 1e3,
                "kernels_per_step": sum(c for _, c in kernels.values()),
                "top": [{"kernel": k[:80], "us_per_step": round(us, 1), "calls_per_step": round(c, 1)}
                        for k, (us, c) in top]}
    finally:
        while engine.has_unfinished:
            engine.step()
        _stop(engine)


def run_offline(spec: dict) -> dict:
    import random

    from inference_service.engine.sampling_params import SamplingParams

    engine = _engine(spec, kv_cache_dtype=spec["kv"], max_num_seqs=256)
    try:
        rng = random.Random(0)
        vocab = engine.loaded.config.vocab_size
        prompts = [[rng.randrange(1, vocab) for _ in range(spec["input"])] for _ in range(spec["requests"])]
        params = SamplingParams(max_tokens=spec["output"], temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        num_out = sum(len(o.completions[0].token_ids) for o in out)
        num_tokens = num_out + spec["input"] * spec["requests"]
        config = engine.loaded.config
        params_count = config.num_hidden_layers * (config.hidden_size * (config.q_size + 2 * config.kv_size)
                                                   + config.q_size * config.hidden_size
                                                   + 3 * config.hidden_size * config.intermediate_size)
        params_count += config.vocab_size * config.hidden_size
        bound = spec["tp"] * H200_BF16_FLOPS / (2 * params_count)  # tokens/s if only the matmuls counted
        return {"output_tok_s": num_out / elapsed, "total_tok_s": num_tokens / elapsed, "seconds": elapsed,
                "compute_bound_tok_s": bound if spec["device"] == "cuda" else None,
                "ratio_to_bound": num_tokens / elapsed / bound if spec["device"] == "cuda" else None}
    finally:
        _stop(engine)


def _time_all_reduces(reduce, x, per_step: int, use_graph: bool) -> float:
    """ms for one step's `per_step` all-reduces of `x`, eagerly or replayed from one CUDA graph."""
    import torch

    def step():
        for _ in range(per_step):
            reduce(x)

    for _ in range(3):
        step()
    run = step
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    if x.is_cuda:
        torch.cuda.synchronize()
    num_steps = 20
    t0 = time.perf_counter()
    for _ in range(num_steps):
        run()
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / num_steps * 1e3


def _allreduce_rank(rank: int, spec: dict, init_method: str, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    from inference_service.distributed.group import destroy_group, init_group

    device = torch.device("cuda", rank) if spec["device"] == "cuda" else torch.device("cpu")
    group = init_group(rank, spec["tp"], init_method, device)
    dtype = torch.bfloat16 if spec["device"] == "cuda" else torch.float32
    x = torch.full((1, spec["hidden"]), float(rank + 1), dtype=dtype, device=device)
    per_step = 2 * spec["layers"] + 1
    expected = sum(range(1, spec["tp"] + 1))
    result = {"allreduces_per_step": per_step, "message_bytes": x.numel() * x.element_size(),
              "symmetric_memory": group.symmetric is not None,
              "sum_ok": bool((group.all_reduce(x.clone()) == expected).all())}
    if group.symmetric is not None:
        result.update(_symmetric_matches_nccl(group.symmetric, rank, device))
    ways = {"nccl": lambda t: dist.all_reduce(t), "engine": group.all_reduce}
    for name, reduce in ways.items():
        result[f"{name}_eager_ms_per_step"] = _time_all_reduces(reduce, x.clone(), per_step, use_graph=False)
        if device.type == "cuda":
            result[f"{name}_graph_ms_per_step"] = _time_all_reduces(reduce, x.clone(), per_step, use_graph=True)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(result, f)
    destroy_group()


def _symmetric_matches_nccl(symmetric, rank: int, device) -> dict:
    """Random sums and broadcasts of several sizes and dtypes, both halves of the buffers many times over: the
    symmetric kernel's results against NCCL's, bit for bit (a sum of two ranks rounds once either way)."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1234 + rank)
    cases = [(8, torch.bfloat16), (4096, torch.bfloat16), (8192, torch.bfloat16), (8192, torch.float16),
             (4096, torch.float32), (65536, torch.bfloat16)] * 20
    sums_differ = 0
    for n, dtype in cases:
        x = (torch.randn(n, generator=gen) * 10).to(dtype).to(device)
        reference = x.clone()
        dist.all_reduce(reference)
        sums_differ += int(not torch.equal(symmetric.all_reduce(x), reference))
    broadcasts_differ = 0
    for n in (2, 300, 5000):
        tokens = torch.randint(0, 2**62, (n,), generator=gen).to(device)
        reference = tokens.clone()
        dist.broadcast(reference, 0)
        broadcasts_differ += int(not torch.equal(symmetric.broadcast(tokens), reference))
    return {"random_sums_differing_from_nccl": f"{sums_differ} of {len(cases)}",
            "random_broadcasts_differing_from_nccl": f"{broadcasts_differ} of 3"}


def run_allreduce(spec: dict) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    out_file = tempfile.mktemp(suffix=".json")
    mp.start_processes(_allreduce_rank, args=(spec, init_method, out_file), nprocs=spec["tp"], start_method="spawn")
    with open(out_file) as f:
        return json.load(f)


def run_case(name: str, spec: dict) -> dict:
    if name == "allreduce":
        return run_allreduce(spec)
    if name.startswith("offline"):
        return run_offline(spec)
    if name.startswith("profile"):
        return run_profile(spec)
    return run_decode(spec)


# ------------------------------------------------------------------------------------------------ driver

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, gloo")
    parser.add_argument("--offline-requests", type=int, default=1000)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        result = run_case(args.case, json.loads(args.spec))
        print("RESULT " + json.dumps(result), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    specs = case_specs(args.smoke, args.offline_requests)
    results = {}
    for name in args.only.split(","):
        started = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--case", name,
               "--spec", json.dumps(specs[name])]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=540, check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode or not lines:
                raise RuntimeError(f"exit {done.returncode}: {done.stderr[-3000:]}")
            results[name] = json.loads(lines[-1][len("RESULT "):])
        except Exception as e:  # noqa: BLE001 - each section reports on its own
            results[name] = {"error": "".join(traceback.format_exception_only(e)).strip()}
        results[name]["wall_s"] = time.perf_counter() - started
        print(f"{name}: {results[name]}", flush=True)
    if "tp1_8b" in results and "tp2_8b" in results and "tok_s" in results["tp1_8b"] and "tok_s" in results["tp2_8b"]:
        results["tp2_over_tp1_8b"] = results["tp2_8b"]["tok_s"] / results["tp1_8b"]["tok_s"]
    if "first_tokens" in results.get("tp2_8b", {}) and "first_tokens" in results.get("tp2_8b_nccl", {}):
        results["tp2_8b_same_tokens_as_nccl"] = results["tp2_8b"]["first_tokens"] == results["tp2_8b_nccl"]["first_tokens"]
    with open(os.path.join(args.out, "gpu_tp.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
