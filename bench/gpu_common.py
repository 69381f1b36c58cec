"""What the GPU bench scripts share: engines on a device, greedy generation, bandwidth and FLOP ceilings."""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client import CollectorRegistry  # noqa: E402

from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from inference_service.engine.llm_engine import LLMEngine  # noqa: E402
from inference_service.engine.sampling_params import SamplingParams  # noqa: E402
from inference_service.metrics import EngineMetrics  # noqa: E402
from inference_service.model.linear import LinearBase  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# "cuda"; `--device cpu` in the scripts sets "cpu": a dry run that checks the scripts, not the GPU.
DEVICE = "cuda"


def make_engine(model: str | None, device: str, dtype: str, *, load_format: str = "auto", kv_mib: int | None = 2048,
                gpu_fraction: float = 0.9, loaded=None, enforce_eager: bool = False, kv_cache_dtype: str = "auto",
                kv_cache_layout: str = "auto", block_size: int = 16,
                async_scheduling: bool | None = None, max_cuda_graph_batch_size: int | None = None,
                profile_dir: str | None = None, profile_steps: tuple[int, int] = (16, 16), **scheduler) -> LLMEngine:
    config = EngineConfig(model=model, device=device, dtype=dtype, load_format=load_format, enforce_eager=enforce_eager,
                          async_scheduling=async_scheduling, max_cuda_graph_batch_size=max_cuda_graph_batch_size,
                          profile_dir=profile_dir, profile_steps=profile_steps,
                          cache=CacheConfig(kv_cache_memory_mib=kv_mib, gpu_memory_fraction=gpu_fraction,
                                            kv_cache_dtype=kv_cache_dtype, kv_cache_layout=kv_cache_layout,
                                            block_size=block_size),
                          scheduler=SchedulerConfig(**scheduler))
    return LLMEngine(config, loaded=loaded, metrics=EngineMetrics("bench", registry=CollectorRegistry()))


def generate(engine: LLMEngine, prompts: list, params: SamplingParams) -> list[list[int]]:
    """All prompts at once; the output token ids of each."""
    return [output.completions[0].token_ids for output in engine.generate(prompts, params)]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where the sequences differ (length mismatch counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


class HostTimer:
    """Accumulates the wall time of calls to wrapped functions, by label."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - t0
        return timed


class GpuStepTimer:
    """Wraps `engine.model_runner.execute_model` and `sample_tokens` to time each step's device work with
    CUDA events: from the first copy of its inputs starting on the GPU to its sampled ids' copy to the host. A GPU-bound
    loop has step wall times equal to these; a host-bound one leaves the GPU idle in between.
    `kinds` labels each step "decode" (one token a sequence) or "mixed" (a prefill in it)."""

    def __init__(self, engine):
        self.events: list[tuple] = []
        self.kinds: list[str] = []
        self.num_seqs: list[int] = []
        runner = engine.model_runner
        execute_model, sample_tokens = runner.execute_model, runner.sample_tokens

        def timed_execute_model(scheduled, *args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._start = start
            self.kinds.append("decode" if all(s.num_new_tokens == 1 for s in scheduled) else "mixed")
            self.num_seqs.append(len(scheduled))
            return execute_model(scheduled, *args, **kwargs)

        def timed_sample_tokens(forward):
            out = sample_tokens(forward)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self._start, end))
            return out

        runner.execute_model, runner.sample_tokens = timed_execute_model, timed_sample_tokens

    def clear(self) -> None:
        self.events.clear()
        self.kinds.clear()
        self.num_seqs.clear()

    def gpu_ms(self) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in self.events]

    def idle_ms(self) -> list[float]:
        """GPU idle time before each step: from the previous step's end to this one's start on the
        stream (0 for the first step; ~0 when the host launched it in time)."""
        torch.cuda.synchronize()
        return [0.0] + [max(0.0, prev[1].elapsed_time(cur[0])) for prev, cur in zip(self.events, self.events[1:])]


def graph_seconds(fn, reps: int = 20) -> float:
    """Median seconds of fn() replayed as a CUDA graph (captured after one call outside it, which compiles and
    autotunes): the device time of what fn launches, without the host's launch overhead."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth_gbs(num_bytes: int = 2**30) -> float:
    """Device-to-device copy, bytes read + written, median of 20 (after 3 warm-ups)."""
    src = torch.randn(num_bytes // 4, device=DEVICE)
    dst = torch.empty_like(src)
    times = []
    for i in range(23):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * num_bytes / times[len(times) // 2] / 1e9


def weight_bytes_per_step(model) -> int:
    """Weights one decode step reads: every projection (lm_head included) and norm; embeddings: one row."""
    total = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            total += module.in_features * module.out_features * model.dtype.itemsize
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(".bias"):
            total += p.numel() * p.element_size()
    return total


def stored_bytes_per_step(model) -> int:
    """Weights one decode step reads as the model keeps them (packed where quantized): `num_weight_bytes` less
    an embedding table no projection shares (a step reads one row of it; tied, it is the lm_head's)."""
    linear_params = {id(p) for m in model.modules() if isinstance(m, LinearBase) for p in m.parameters()}
    table = sum(p.numel() * p.element_size() for p in model.model.embed_tokens.parameters()
                if id(p) not in linear_params)
    return model.num_weight_bytes - table


def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense matmul rate of the device (median of 10 n x n x n products after 3 warm-ups)."""
    a = torch.randn(n, n, device=DEVICE).to(dtype)
    b = torch.randn(n, n, device=DEVICE).to(dtype)
    times = []
    for i in range(13):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e12


def sustained_matmul_tflops(n: int, dtype: torch.dtype, seconds: float) -> float:
    """The n x n x n product's rate over ~`seconds` of back-to-back products (timed by CUDA events)."""
    a, b = torch.randn(n, n, device=DEVICE).to(dtype), torch.randn(n, n, device=DEVICE).to(dtype)
    a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ b
    end.record()
    end.synchronize()
    reps = max(1, int(seconds * 1e3 / start.elapsed_time(end)))
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) * 1e-3) / 1e12


def ttft_roofline_ms(engine, n: int, tflops: float) -> float:
    """The FLOP roofline of a prompt of n tokens at `tflops`: 2 FLOPs a weight a token (the lm_head's too) + causal
    attention (QK^T, PV)."""
    cfg = engine.loaded.config
    linear_params = weight_bytes_per_step(engine.loaded.model) / engine.loaded.model.dtype.itemsize
    flops = 2 * linear_params * n + 2 * n * n * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return flops / (tflops * 1e12) * 1e3


class ClockSampler:
    """The GPU's SM clock, power draw and clock-limit reasons sampled every 2 ms in a thread (NVML) while the block
    runs: `summary()` gives the clock's and the power's {min, median, max} and how often each reason held, or None
    without NVML. Issue 17's TTFT roofline takes the matmul rate of short products; this says whether a long
    prefill ran at the clock that rate was measured at, and what held it back."""

    def __enter__(self):
        import threading

        self.samples: list[tuple[int, float, tuple[str, ...]]] = []  # (SM MHz, watts, limit reasons)
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            reasons = {name[len("nvmlClocksEventReason"):]: getattr(pynvml, name) for name in dir(pynvml)
                       if name.startswith("nvmlClocksEventReason") and name[len("nvmlClocksEventReason"):] not in
                       ("None", "All", "Unknown")}

            def read() -> tuple[int, float, tuple[str, ...]]:
                mask = pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
                return (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                        tuple(name for name, bit in reasons.items() if mask & bit))

            read()
        except Exception:  # noqa: BLE001 - no NVML: no samples
            return self

        def sample() -> None:
            while not self._stop.wait(0.002):
                self.samples.append(read())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if getattr(self, "_thread", None) is not None:
            self._thread.join()

    def summary(self) -> dict | None:
        if not self.samples:
            return None

        def spread(values: list) -> dict:
            ordered = sorted(values)
            return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}

        held: dict[str, int] = {}
        for _, _, names in self.samples:
            for name in names:
                held[name] = held.get(name, 0) + 1
        return {"sm_mhz": spread([c for c, _, _ in self.samples]), "power_w": spread([p for _, p, _ in self.samples]),
                "samples": len(self.samples), "limit_reasons": held}


def free_device_memory() -> None:
    import gc

    gc.unfreeze()  # objects frozen with an engine (gc_heap.freeze_startup_heap) become collectable again
    gc.collect()
    if DEVICE != "cpu":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
