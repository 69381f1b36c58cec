"""Performance sections of `bench/gpu_engine.py` (Llama-3-8B and SmolLM2 with dummy weights on one GPU).

  decode    batch 1, 128-token prompt, 512 new tokens, CUDA graphs and eager: decode tok/s against the
            roofline = copy bandwidth (measured here) / weight bytes read per step.
  cpu_step  host time per decode step at 1 and 256 running sequences, split into schedule, input
            preparation, sampling-batch build and output processing, next to the step's wall time.
  ttft      time to first token of 1k and 4k prompts against the FLOP roofline from the bf16 matmul
            rate measured here.
  offline   N requests of 1000 random prompt tokens and 1000 output tokens (ignore_eos), output tok/s,
            with a bf16 KV cache (256 sequences at once) and an fp8 one (384: twice the blocks).
  grpc_smol SmolLM2-135M (dummy weights, same shapes) served by a real engine process, batch 1 through
            the gRPC API: decode tok/s as a client sees it.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
import time

import torch

import gpu_common as common
from gpu_common import CONFIGS, copy_bandwidth_gbs, free_device_memory, generate, make_engine, matmul_tflops, sync
from gpu_common import HostTimer, weight_bytes_per_step

from inference_service.engine.gc_heap import freeze_startup_heap
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.model_runner import LaunchedStep
from inference_service.engine.sampling_state import SamplingState
from inference_service.engine.sampling_params import SamplingParams
from inference_service.model.loader import load_model


def load_llama(config: str = "llama-3-8b", quantization: str = ""):
    """(the dummy-weight model of bench/configs/`config`, seconds it took); `quantization` (fp8, int8, int4)
    quantizes it in situ as `serve --quantization` does."""
    t0 = time.perf_counter()
    loaded = load_model(os.path.join(CONFIGS, config), device=common.DEVICE, dtype=torch.bfloat16, load_format="dummy")
    if quantization:
        from inference_service.model.quantization import quantize_loaded_model, summarize_model

        model = quantize_loaded_model(loaded.model, quantization)
        loaded = dataclasses.replace(loaded, model=model, quantization=summarize_model(model, quantization))
    return loaded, time.perf_counter() - t0


def _engine(loaded, **kwargs) -> LLMEngine:
    """An engine as the server runs it: built, then the heap frozen (`free_device_memory` unfreezes)."""
    kv_mib = None if common.DEVICE != "cpu" else 1024
    engine = make_engine(loaded.model_path, common.DEVICE, "bfloat16", load_format="dummy", loaded=loaded,
                         kv_mib=kv_mib, **kwargs)
    freeze_startup_heap()
    return engine


def _random_prompt(n: int, seed: int, vocab_size: int = 128000) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DECODE_MODES = {"graphs": (False, True), "graphs_nopdl": (False, True), "graphs_sync": (False, False),
                "eager": (True, True)}  # mode: (enforce_eager, async_scheduling)


def decode(loaded, results: dict, prompt_len: int = 128, new_tokens: int = 512,
           modes: tuple[str, ...] = tuple(DECODE_MODES)) -> None:
    bw = copy_bandwidth_gbs()
    weight_bytes = weight_bytes_per_step(loaded.model)
    roofline = bw * 1e9 / weight_bytes
    results["decode_roofline"] = {"copy_gbs": round(bw, 1), "weight_gb_per_step": round(weight_bytes / 1e9, 3),
                                  "roofline_tok_s": round(roofline, 1), "target_tok_s": 170}
    # graphs_nopdl: the kernels launched without programmatic dependent launch (kernels._common.pdl_args)
    for mode in modes:
        eager, is_async = DECODE_MODES[mode]
        os.environ["KERNELS_PDL"] = "0" if mode == "graphs_nopdl" else "1"
        engine = _engine(loaded, enforce_eager=eager, async_scheduling=is_async)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        generate(engine, [_random_prompt(32, 9)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        engine.add_request(engine.input_processor.process("bench", _random_prompt(prompt_len, 0), params))
        sync()
        stamps = [time.perf_counter()]
        while engine.has_unfinished:
            engine.step()
            stamps.append(time.perf_counter())
        tok_s = (new_tokens - 1) / (stamps[-1] - stamps[1])
        step_ms = sorted((b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:]))
        results[f"decode_bf16_{mode}"] = {
            "batch": 1, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "decode_tok_s": round(tok_s, 1),
            "ratio_to_roofline": round(tok_s / roofline, 3), "ttft_ms": round((stamps[1] - stamps[0]) * 1e3, 1),
            "step_ms_median": round(step_ms[len(step_ms) // 2], 3), "kv_blocks": engine.model_runner.num_blocks,
        }
        print(f"decode ({mode}):", results[f"decode_bf16_{mode}"], flush=True)
        del engine
        free_device_memory()
    os.environ.pop("KERNELS_PDL")


def cpu_step(loaded, results: dict, steps: int = 40) -> None:
    """Host-side cost of a decode step at 1 and 256 sequences, with and without async scheduling.
    The model's GPU work is the graph replay (asynchronous); what the host does besides is schedule,
    prepare inputs, build the sampling batch, queue the sampling and process outputs. `wait_for_gpu`
    is the time blocked waiting for a step's sampled ids."""
    for is_async in (False, True):
        _cpu_step(loaded, results, steps, is_async)


def _cpu_step(loaded, results: dict, steps: int, is_async: bool) -> None:
    engine = _engine(loaded, max_num_seqs=256, async_scheduling=is_async)
    runner = engine.model_runner
    timer = HostTimer()
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    runner.inputs.prepare = timer.wrap("prepare_inputs", runner.inputs.prepare)
    engine.update_from_output = timer.wrap("update_from_output", engine.update_from_output)
    runner.sampler.sample = timer.wrap("sample_launch", runner.sampler.sample)
    gpu_timer = common.GpuStepTimer(engine) if common.DEVICE != "cpu" else None
    original_build, original_result = SamplingState.batch, LaunchedStep.result
    SamplingState.batch = timer.wrap("sampling_batch_build", original_build)
    LaunchedStep.result = timer.wrap("wait_for_gpu", original_result)
    try:
        for num_seqs in (1, 256):
            params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
            for i in range(num_seqs):
                engine.add_request(engine.input_processor.process(f"c{num_seqs}-{i}", _random_prompt(64, i), params))
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running + list(
                    engine.scheduler.waiting)):
                engine.step()  # prefills
            engine.step()
            sync()
            timer.totals.clear()
            if gpu_timer:
                gpu_timer.clear()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = (time.perf_counter() - t0) / steps
            gpu_ms = sorted(gpu_timer.gpu_ms())[steps // 2] if gpu_timer else 0.0
            per_step = {k: round(v / steps * 1e3, 3) for k, v in timer.totals.items()}
            host = sum(v for k, v in per_step.items() if k != "wait_for_gpu")
            key = f"cpu_step_{num_seqs}{'_async' if is_async else ''}"
            results[key] = {"running_seqs": len(engine.scheduler.running), "step_wall_ms": round(wall * 1e3, 3),
                            "gpu_ms_median": round(gpu_ms, 3), "host_ms": round(host, 3), **per_step}
            print(f"cpu step at {num_seqs} (async {is_async}):", results[key], flush=True)
            engine.run_until_idle()
    finally:
        SamplingState.batch, LaunchedStep.result = original_build, original_result
    del engine
    free_device_memory()


def ttft(loaded, results: dict) -> None:
    tflops = matmul_tflops()
    cfg = loaded.config
    engine = _engine(loaded)
    linear_params = weight_bytes_per_step(loaded.model) / 2  # bf16: every projection incl. lm_head
    out = {"matmul_tflops": round(tflops, 1)}
    for n in (1024, 4096):
        generate(engine, [_random_prompt(n, 5)], SamplingParams(temperature=0.0, max_tokens=1))  # warm (shapes)
        times = []
        for rep in range(3):
            engine.add_request(engine.input_processor.process(
                f"t{n}-{rep}", _random_prompt(n, 100 + rep), SamplingParams(temperature=0.0, max_tokens=1)))
            sync()
            t0 = time.perf_counter()  # the step loop alone: validating the prompt is not time to first token
            engine.run_until_idle()
            times.append(time.perf_counter() - t0)
        # 2 FLOPs per weight per token (lm_head for the last token only, negligible) + causal attention:
        # QK^T and PV, 2 * 2 * n^2 / 2 * hidden per layer.
        flops = 2 * linear_params * n + 2 * n * n * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
        roof_ms = flops / (tflops * 1e12) * 1e3
        best = min(times) * 1e3
        out[f"prompt_{n}"] = {"ttft_ms": round(best, 2), "flop_roofline_ms": round(roof_ms, 2),
                              "ratio": round(best / roof_ms, 2), "target_ratio": 1.5}
    results["ttft_bf16"] = out
    print("ttft:", out, flush=True)
    del engine
    free_device_memory()


class _GcPauses:
    """A `gc.callbacks` hook: the time the collector stops the program, by generation."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self.longest_ms = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        self.seconds[info["generation"]] += pause
        self.counts[info["generation"]] += 1
        self.longest_ms = max(self.longest_ms, pause * 1e3)

    def summary(self) -> dict:
        return {"pause_s_by_gen": [round(x, 3) for x in self.seconds], "collections_by_gen": self.counts,
                "longest_ms": round(self.longest_ms, 2)}


def _full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return round((time.perf_counter() - start) * 1e3, 2)


def _idle_gaps(idle_ms: list[float], gpu_timer) -> dict:
    """Where the GPU waited for the host: idle time by size of gap, and the longest gaps with their steps."""
    buckets = {"lt_0.1ms": 0.0, "0.1_1ms": 0.0, "1_10ms": 0.0, "ge_10ms": 0.0}
    for gap in idle_ms:
        key = "lt_0.1ms" if gap < 0.1 else "0.1_1ms" if gap < 1 else "1_10ms" if gap < 10 else "ge_10ms"
        buckets[key] += gap / 1e3
    longest = sorted(range(len(idle_ms)), key=idle_ms.__getitem__, reverse=True)[:8]
    return {"seconds_by_gap": {k: round(v, 2) for k, v in buckets.items()},
            "longest": [{"step": i, "idle_ms": round(idle_ms[i], 2), "kind": gpu_timer.kinds[i],
                         "prev_kind": gpu_timer.kinds[i - 1] if i else None, "num_seqs": gpu_timer.num_seqs[i]}
                        for i in longest]}


def offline(loaded, results: dict, num_requests: int, prompt_len: int = 1000, output_len: int = 1000,
            kv_cache_dtype: str = "auto", max_num_seqs: int = 256, time_limit_s: float = 240.0,
            profile_dir: str | None = None, profile_steps: tuple[int, int] = (16, 16),
            kv_cache_layout: str = "auto", block_size: int = 16) -> None:
    # The server's defaults (graphs up to --max-num-seqs included): this measures the configuration `serve` ships.
    # `profile_dir`: the engine's torch.profiler over `profile_steps` (serve --profile-dir); it slows those steps.
    engine = _engine(loaded, kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs, profile_dir=profile_dir,
                     profile_steps=profile_steps, kv_cache_layout=kv_cache_layout, block_size=block_size)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(engine.input_processor.process(f"o{i}", _random_prompt(prompt_len, 1000 + i), params))
    gpu_timer = common.GpuStepTimer(engine) if common.DEVICE != "cpu" else None
    host = HostTimer()
    engine.scheduler.schedule = host.wrap("schedule", engine.scheduler.schedule)
    engine.model_runner.inputs.prepare = host.wrap("prepare_inputs", engine.model_runner.inputs.prepare)
    engine.update_from_output = host.wrap("update_from_output", engine.update_from_output)
    gc_pauses = _GcPauses()
    gc.callbacks.append(gc_pauses)
    t0 = time.perf_counter()
    num_out, steps, walls = 0, 0, []
    try:
        while engine.has_unfinished and time.perf_counter() - t0 < time_limit_s:
            num_out += sum(len(d.token_ids) for d in engine.step())
            steps += 1
            walls.append(time.perf_counter())
    finally:
        gc.callbacks.remove(gc_pauses)
    elapsed = time.perf_counter() - t0
    # Step i's wall time is the call that launched step i+1 and waited for step i (async scheduling).
    split = {}
    if gpu_timer:
        gpu, idle = gpu_timer.gpu_ms(), gpu_timer.idle_ms()
        wall_ms = [(b - a) * 1e3 for a, b in zip(walls, walls[1:])]
        for kind in ("decode", "mixed"):
            idx = [i for i, k in enumerate(gpu_timer.kinds[:len(wall_ms)]) if k == kind]
            split[kind] = {"steps": len(idx), "gpu_s": round(sum(gpu[i] for i in idx) / 1e3, 1),
                           "wall_s": round(sum(wall_ms[i] for i in idx) / 1e3, 1),
                           "gpu_idle_before_s": round(sum(idle[i] for i in idx) / 1e3, 2)}
        split["idle_gaps"] = _idle_gaps(idle, gpu_timer)
    weights = loaded.quantization.quantization if loaded.quantization else "none"
    weights_tag = "" if weights == "none" else weights.replace(" ", "_") + "_weights_"
    layout_tag = ("" if kv_cache_layout == "auto" else f"_{kv_cache_layout}") + (
        "" if block_size == 16 else f"_block{block_size}")
    key = f"offline_{weights_tag}{'fp8' if kv_cache_dtype == 'fp8' else 'bf16'}_kv{layout_tag}_seqs{max_num_seqs}"
    results[key] = {
        "requests": num_requests, "max_num_seqs": max_num_seqs, "kv_cache_layout": kv_cache_layout,
        "block_size": block_size,
        "prompt_tokens": prompt_len, "output_tokens": output_len,
        "finished": not engine.has_unfinished, "elapsed_s": round(elapsed, 1), "output_tokens_done": num_out,
        "steps": steps, "output_tok_s": round(num_out / elapsed, 1), "preemptions": engine.scheduler.num_preemptions,
        "kv_blocks": engine.model_runner.num_blocks, "target_tok_s": 10000 if kv_cache_dtype == "fp8" else 7000,
        "by_step_kind": split, "host_s": {k: round(v, 2) for k, v in host.totals.items()}, "gc": gc_pauses.summary(),
    }
    results[key]["gc"]["full_collection_ms"] = {"frozen": _full_collection_ms()}
    gc.unfreeze()
    results[key]["gc"]["full_collection_ms"]["unfrozen"] = _full_collection_ms()
    print(f"offline ({kv_cache_dtype} KV):", results[key], flush=True)
    del engine
    free_device_memory()


def grpc_smol(results: dict, new_tokens: int = 512) -> None:
    import decode_throughput  # the CPU bench's gRPC client
    from tests.grpc_client import start_engine

    log = os.path.join(tempfile.mkdtemp(), "engine.log")
    for flag in ("--async-scheduling", "--no-async-scheduling"):
        engine = start_engine("--model", os.path.join(CONFIGS, "smollm2-135m"), "--load-format", "dummy", "--device",
                              common.DEVICE, "--dtype", "bfloat16", "--kv-cache-memory", "4096", flag, log_path=log)
        try:
            decode_throughput.stream_decode_rate(engine.target, 1, 16)  # warm up
            rates = [decode_throughput.stream_decode_rate(engine.target, 1, new_tokens) for _ in range(3)]
            rate16, _ = decode_throughput.stream_decode_rate(engine.target, 16, new_tokens)
        finally:
            engine.stop()
        key = "grpc_smollm2_bf16" + ("" if flag == "--async-scheduling" else "_sync")
        results[key] = {"batch1_decode_tok_s": [round(r, 1) for r, _ in rates],
                        "ttft_ms": [round(f * 1e3, 1) for _, f in rates], "concurrent16_tok_s": round(rate16, 1),
                        "target_tok_s": 1000}
        print(f"gRPC SmolLM2 ({flag}):", results[key], flush=True)
