"""Where a batch-1 decode step's GPU time goes (Llama-3-8B bf16, dummy weights), on one GPU.

  gemv      each linear layer's shape at one row: torch's matmul (cuBLAS) against `kernels.gemv`
            over a grid of tile configurations, as bandwidth (weight bytes / time) next to the copy
            bandwidth measured here. Weights rotate over copies larger than L2, timed as CUDA-graph
            replays.
  attention paged decode attention alone at --batch x --context (Llama-3-8B heads), bf16 and fp8
            K/V, over tile configurations and split counts: time and bandwidth of the K/V bytes.
  profile   the engine's decode steps (CUDA graphs) under torch.profiler: GPU time per step by
            kernel, and their sum against the step's wall time.
  prefill   time to first token of --prefill-lens prompts (the engine built from `serve`'s flags, as
            bench/served_path.py builds it) against the FLOP roofline, and one prompt of each length under
            torch.profiler: GPU time by kernel against the wall time.

Usage: python bench/gpu_decode_profile.py [--only gemv,attention,profile,prefill] [--batch B --context C]
       [--attention-shapes 256x1500,1x640]
       [--kv-cache-dtype fp8] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_common as common  # noqa: E402

# (name, N, K) of Llama-3-8B's projections, whole and on one rank of two (tensor parallelism: column-parallel
# qkv, gate_up and lm_head halve N, row-parallel o and down halve K)
SHAPES = {"llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                         ("lm_head", 128256, 4096)],
          "llama-3-8b-tp2": [("qkv", 3072, 4096), ("o", 4096, 2048), ("gate_up", 14336, 4096), ("down", 4096, 7168),
                             ("lm_head", 64128, 4096)],
          "phi-3-mini": [("qkv", 9216, 3072), ("o", 3072, 3072), ("gate_up", 16384, 3072), ("down", 3072, 8192),
                         ("lm_head", 32064, 3072)],
          "qwen3-30b-a3b": [("qkv", 5120, 2048), ("o", 2048, 4096), ("router", 128, 2048), ("lm_head", 151936, 2048)]}
CONFIGS = [(bn, bk, warps, stages) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024) for warps in (4, 8)
           for stages in (2, 3)]


def _graph_time_ms(fn, calls: int) -> float:
    """Median time of one `fn(i)` (i = 0..calls-1) from replays of a graph of all the calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def gemv_section(results: dict, shapes: str = "llama-3-8b") -> None:
    from kernels.gemv import gemv, gemv_ref

    copy_gbs = common.copy_bandwidth_gbs()
    out = {"copy_gbs": round(copy_gbs, 1), "shapes": shapes}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES[shapes]:
        copies = max(2, -(-300 * 2**20 // (n * k * 2)))  # > 300 MiB in all, far past L2
        ws = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(copies)]
        # Each projection as the fused decode path calls it: the RMSNorm in qkv's and gate_up's prologue, the
        # residual add in o's and down's epilogue, the SiLU gate in down's prologue.
        gated = name == "down"
        x = torch.randn(1, 2 * k if gated else k, device="cuda", generator=gen, dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        extra = ({"norm_weight": torch.ones(k, device="cuda", dtype=torch.bfloat16)} if name in ("qkv", "gate_up")
                 else {"residual": torch.zeros(1, n, device="cuda", dtype=torch.bfloat16), "gated": gated}
                 if name in ("o", "down") else {})
        ref = gemv_ref(x, ws[0], **extra).float()
        calls = 2 * copies
        gbs = lambda ms: n * k * 2 / (ms * 1e-3) / 1e9  # noqa: E731
        row = {"cublas_gbs": round(gbs(_graph_time_ms(lambda i: torch.matmul(x[:, :k], ws[i % copies].t(), out=y),
                                                         calls)), 1),
               "default_gbs": round(gbs(_graph_time_ms(lambda i: gemv(x, ws[i % copies], out=y, **extra), calls)), 1)}
        best = None
        for bn, bk, warps, stages in CONFIGS:
            try:
                got = gemv(x, ws[0], block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, **extra)
                err = ((got.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    row[f"error_{bn}_{bk}_{warps}_{stages}"] = err
                    continue
                ms = _graph_time_ms(lambda i: gemv(x, ws[i % copies], out=y, block_n=bn, block_k=bk, num_warps=warps,
                                                   num_stages=stages, **extra), calls)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                row[f"failed_{bn}_{bk}_{warps}_{stages}"] = repr(e)[:200]
                continue
            row.setdefault("all_gbs", {})[f"{bn}_{bk}_{warps}_{stages}"] = round(gbs(ms), 1)
            if best is None or ms < best[0]:
                best = (ms, (bn, bk, warps, stages))
        row["triton_best_gbs"], row["triton_best_config"] = round(gbs(best[0]), 1), best[1]
        row["ratio_triton_to_cublas"] = round(row["triton_best_gbs"] / row["cublas_gbs"], 3)
        out[name] = row
        print(f"gemv {name} [{n}x{k}]: {row}", flush=True)
        del ws
        torch.cuda.empty_cache()
    results[f"gemv_{shapes}"] = out


ATTENTION_CONFIGS = ((None, None, None), (32, 4, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3))


def attention_section(results: dict, batch: int, context: int, configs=ATTENTION_CONFIGS,
                      layouts: tuple[str, ...] = ("nhd", "hnd")) -> None:
    """Decode attention alone at batch x context: bf16 and fp8 K/V, the engine's [block, token, head, dim]
    cache layout ("nhd") against [block, head, token, dim] ("hnd", a strided view), over tile configs
    and split counts (the launcher's, and the 64 a CUDA graph captures
    for long contexts)."""
    from kernels import FP8_DTYPE
    from kernels.decode_attention import paged_decode_attention
    from kernels.split_kv import MAX_KV_SPLITS, choose_num_kv_splits

    num_q_heads, num_kv_heads, head_dim, page = 32, 8, 128, 16
    copy_gbs = common.copy_bandwidth_gbs()
    pages = -(-context // page)
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_sets = max(2, -(-400 * 2**20 // (batch * context * num_kv_heads * head_dim * 2)))  # > 400 MiB of fp8 K+V
    num_blocks = num_sets * batch * pages + 1
    perm = (torch.randperm(num_blocks - 1) + 1).to(torch.int32)  # scattered pages, as in a live cache
    tables = perm.view(num_sets, batch, pages).cuda()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_q_heads, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    out = {"batch": batch, "context": context, "copy_gbs": round(copy_gbs, 1)}
    auto = choose_num_kv_splits(batch, num_kv_heads, context, q.device)
    split_cases = [auto] + ([MAX_KV_SPLITS] if batch <= 8 else [2] if auto == 1 else [])
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8_DTYPE)):
        for layout in layouts:
            shape = (num_blocks, page, num_kv_heads, head_dim) if layout == "nhd" else (num_blocks, num_kv_heads, page,
                                                                                          head_dim)
            caches = [torch.randn(shape, device="cuda", generator=gen).to(dtype) for _ in range(2)]
            if layout == "hnd":
                caches = [c.transpose(1, 2) for c in caches]  # logical [block, token, head, dim]
            k_cache, v_cache = caches
            kv_bytes = 2 * batch * context * num_kv_heads * head_dim * k_cache.element_size()
            rows = []
            for splits, (bn, warps, stages) in itertools.product(
                    split_cases, configs):
                if layout == "hnd" and splits != auto:
                    continue

                def call(i, splits=splits, bn=bn, warps=warps, stages=stages):
                    paged_decode_attention(q, k_cache, v_cache, tables[i % num_sets], seq_lens, 0.088, k_scale=0.5,
                                           v_scale=0.5, num_kv_splits=splits, block_n=bn, num_warps=warps,
                                           num_stages=stages)
                cfg = {"splits": splits, "cfg": (bn, warps, stages) if bn else "default"}
                try:
                    ms = _graph_time_ms(call, 2 * num_sets)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                    rows.append({**cfg, "failed": repr(e)[:120]})
                    continue
                rows.append({**cfg, "us": round(ms * 1e3, 1), "gbs": round(kv_bytes / (ms * 1e-3) / 1e9, 1)})
            ok = [r for r in rows if "us" in r]
            default = next(r for r in ok if r["splits"] == auto and r["cfg"] == "default")
            out[f"{name}_{layout}"] = {"kv_gb": round(kv_bytes / 1e9, 3), "auto_splits": auto, "default": default,
                                       "best": min(ok, key=lambda r: r["us"]), "all": rows}
            print(f"attention {name} {layout} b{batch} ctx{context}: default {default} best "
                  f"{out[f'{name}_{layout}']['best']}", flush=True)
            del k_cache, v_cache, caches
            torch.cuda.empty_cache()
    results[f"decode_attention_b{batch}_ctx{context}"] = out


def profile_section(results: dict, out_dir: str, batch: int = 1, context: int = 128, steps: int = 20,
                    kv_cache_dtype: str = "auto", config: str = "llama-3-8b", quantization: str = "") -> None:
    from torch.profiler import ProfilerActivity, profile

    import gpu_perf
    from inference_service.engine.sampling_params import SamplingParams

    loaded, _ = gpu_perf.load_llama(config, quantization)  # in situ, from the dummy bf16 weights
    engine = gpu_perf._engine(loaded, max_num_seqs=max(batch, 256), kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
    for i in range(batch):
        engine.add_request(engine.input_processor.process(f"p{i}", gpu_perf._random_prompt(context, i, min(128000, loaded.config.vocab_size)), params))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(
            engine.scheduler.waiting)):
        engine.step()  # prefills
    engine.step()
    common.sync()
    t0 = time.perf_counter()
    for _ in range(10):
        engine.step()
    common.sync()
    unprofiled_ms = (time.perf_counter() - t0) * 1e3 / 10
    graph_ms = None
    if engine.model_runner.graphs is not None:  # the captured step alone, back to back: no host work between
        size = engine.model_runner.graphs.padded_size(batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            engine.model_runner.graphs.replay(size)
        end.record()
        end.synchronize()
        graph_ms = start.elapsed_time(end) / 10
    with profile(activities=[ProfilerActivity.CUDA]) as timeline:  # device only: little host overhead
        for _ in range(5):
            engine.step()
        common.sync()
    name = f"{config}{'_' + quantization if quantization else ''}_b{batch}_ctx{context}_{kv_cache_dtype}"
    timeline.export_chrome_trace(os.path.join(out_dir, f"timeline_{name}.json"))
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        common.sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    kernels = {}
    for evt in prof.key_averages():
        device_us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if device_us > 0:
            kernels[evt.key] = (device_us / steps, evt.count / steps)
    total_us = sum(us for us, _ in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    results[f"decode_profile_{name}"] = {
        "step_wall_ms": round(unprofiled_ms, 3), "graph_replay_ms": graph_ms and round(graph_ms, 3),
        "step_wall_ms_under_profiler": round(wall_ms, 3), "gpu_kernel_ms_per_step": round(total_us / 1e3, 3),
        "kernels_per_step": round(sum(c for _, c in kernels.values()), 1),
        "top": [{"kernel": k[:90], "us_per_step": round(us, 1), "calls_per_step": round(c, 1)} for k, (us, c) in top],
    }
    print(json.dumps(results[f"decode_profile_{name}"], indent=1), flush=True)
    del engine, loaded, timeline, prof
    common.free_device_memory()


def _ttft_ms(engine, n: int, seed: int, params) -> float:
    """ms from adding a fresh prompt of n tokens to its first token, the engine otherwise idle."""
    import served_path

    engine.add_request(engine.input_processor.process(f"t{n}-{seed}", served_path._prompt(n, seed, engine), params))
    common.sync()
    t0 = time.perf_counter()
    engine.run_until_idle()
    return (time.perf_counter() - t0) * 1e3


def prefill_section(results: dict, out_dir: str, lens: tuple[int, ...] = (1024, 4096),
                    setup: dict | None = None) -> None:
    from prometheus_client import CollectorRegistry
    from torch.profiler import ProfilerActivity, profile

    import served_path
    from inference_service.cli import build_parser, configs_from_args
    from inference_service.engine.llm_engine import LLMEngine
    from inference_service.engine.sampling_params import SamplingParams
    from inference_service.metrics import EngineMetrics

    setup = setup or served_path.GPU
    config, _ = configs_from_args(build_parser().parse_args(["serve", *served_path.serve_flags(setup)]))
    engine = LLMEngine(config, metrics=EngineMetrics("bench", registry=CollectorRegistry()))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.generate([served_path._prompt(64, 7 + i, engine) for i in range(4)], one)
    tflops = common.matmul_tflops(setup["matmul_n"], engine.loaded.model.dtype)
    out = {"matmul_tflops": round(tflops, 1), "sustained_matmul": {}, "lens": {}}
    for seconds in (0.1, 1.0):  # the roofline's product back to back: a 4k prefill's length, and ten of them
        with common.ClockSampler() as clocks:
            sustained = common.sustained_matmul_tflops(setup["matmul_n"], engine.loaded.model.dtype, seconds)
        out["sustained_matmul"][f"{seconds:g}s"] = {"tflops": round(sustained, 1), "gpu": clocks.summary()}
    for n in lens:
        roofline_ms = common.ttft_roofline_ms(engine, n, tflops)
        times, rested = [], []
        with common.ClockSampler() as clocks:
            for rep in range(4):
                times.append(_ttft_ms(engine, n, 900 + n + rep, one))
        for rep in range(3):  # each after a second of idle GPU: what a burst-rated clock gives one prompt
            time.sleep(1.0)
            rested.append(_ttft_ms(engine, n, 950 + n + rep, one))
        engine.add_request(engine.input_processor.process(f"p{n}", served_path._prompt(n, 990 + n, engine), one))
        common.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.run_until_idle()
            common.sync()
        kernels = {}
        for evt in prof.key_averages():
            device_us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
            if device_us > 0:
                kernels[evt.key] = (device_us, evt.count)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
        out["lens"][str(n)] = {
            "ttft_ms_best": round(min(times), 2), "ttft_ms_all": [round(t, 2) for t in times],
            "ttft_ms_after_1s_idle": [round(t, 2) for t in rested],
            "roofline_ms": round(roofline_ms, 2), "ratio": round(min(times) / roofline_ms, 3),
            "gpu_while_prefilling": clocks.summary(),
            "gpu_kernel_ms": round(sum(us for us, _ in kernels.values()) / 1e3, 2),
            "top": [{"kernel": k[:110], "us": round(us, 1), "calls": c} for k, (us, c) in top]}
        prof.export_chrome_trace(os.path.join(out_dir, f"prefill_{n}.json"))
        print(json.dumps({n: {k: v for k, v in out["lens"][str(n)].items() if k != "top"}}), flush=True)
    results["prefill"] = out
    print(json.dumps(out, indent=1), flush=True)
    del engine
    common.free_device_memory()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="gemv,profile")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_profile"))
    parser.add_argument("--batch", type=int, default=1, help="running sequences in the profiled decode steps")
    parser.add_argument("--attention-shapes", default="",
                        help="BxC,... shapes of the attention section (default: --batch x --context)")
    parser.add_argument("--attention-configs", default="",
                        help="block_n,warps,stages;... tile configs of the attention section besides the default")
    parser.add_argument("--attention-layouts", default="nhd,hnd", help="cache layouts of the attention section")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens of each profiled sequence")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (profile section)")
    parser.add_argument("--configs", default="llama-3-8b",
                        help="bench/configs models the profile section runs, each optionally :int4/:int8/:fp8 "
                             "(quantized in situ), e.g. llama-3-8b,llama-3-8b:int4,qwen3-30b-a3b")
    parser.add_argument("--prefill-lens", default="1024,4096", help="prompt lengths of the prefill section")
    parser.add_argument("--gemv-shapes", default="llama-3-8b",
                        help=f"comma-separated, of {sorted(SHAPES)} (llama-3-8b-tp2: one rank of two)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    configs = ATTENTION_CONFIGS
    if args.attention_configs:
        configs = ((None, None, None),) + tuple(tuple(map(int, config.split(",")))
                                                 for config in args.attention_configs.split(";"))
    layouts = tuple(args.attention_layouts.split(","))
    results = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("COMMIT", "unknown"),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    shapes = (args.attention_shapes or f"{args.batch}x{args.context}").split(",")
    sections = {"gemv": lambda r: [gemv_section(r, shapes) for shapes in args.gemv_shapes.split(",")],
                "attention": lambda r: [attention_section(r, *map(int, shape.split("x")), configs, layouts)
                                        for shape in shapes],
                "profile": lambda r: [profile_section(r, args.out, batch=args.batch, context=args.context,
                                                      kv_cache_dtype=args.kv_cache_dtype, config=config,
                                                      quantization=quantization)
                                      for config, _, quantization in (c.partition(":")
                                                                      for c in args.configs.split(","))],
                "prefill": lambda r: prefill_section(r, args.out, tuple(map(int, args.prefill_lens.split(","))))}
    for name in args.only.split(","):
        try:
            sections[name](results)
        except Exception:  # noqa: BLE001 - report and go on
            import traceback
            results.setdefault("errors", {})[name] = traceback.format_exc()
            print(results["errors"][name], flush=True)
        with open(os.path.join(args.out, "gpu_decode_profile.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
