"""Engine and server configuration, validated on construction. Built by `cli.py` alone."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

# `--quantization`: a 16-bit checkpoint's projections quantized at load (`model.quant.in_situ`)
IN_SITU_QUANTIZATIONS = ("fp8", "int8", "int4", "q4_k")

# vLLM's spellings of the same types: "half"/"float" dtypes, "fp8_e4m3" (our fp8 is e4m3).
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8", "float16": "fp16"}


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    # Cache size in MiB; None on CPU means 1024 MiB, on a GPU `gpu_memory_fraction` decides.
    kv_cache_memory_mib: int | None = None
    # Fraction of the device's free memory, after the model is loaded, given to the KV cache.
    gpu_memory_fraction: float = 0.9
    # vLLM's meaning instead: fraction of the device's TOTAL memory this engine may use in all (weights,
    # activations, KV cache); set, it replaces `gpu_memory_fraction`. None = not given.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    # "auto" = the model dtype; "fp8" = e4m3 with unit scales (Triton backend only): half the bytes; "fp16" (CPU
    # backend only, as llama.cpp's default cache): half a float32 model's bytes.
    kv_cache_dtype: str = "auto"
    # Memory order of a cache block: "hnd" = [heads, tokens, dim], each head's tokens of a block one
    # contiguous run (what the decode attention streams fastest on a GPU); "nhd" = [tokens, heads, dim];
    # "auto" = hnd for the Triton attention backend, nhd for the CPU one (whose kernels read tokens).
    kv_cache_layout: str = "auto"

    def __post_init__(self):
        self.kv_cache_dtype = _KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in ("auto", "fp8", "fp16"):
            raise ValueError("--kv-cache-dtype must be auto, fp8 (fp8_e4m3) or fp16 (float16), "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_layout not in ("auto", "nhd", "hnd"):
            raise ValueError(f"--kv-cache-layout must be auto, nhd or hnd, got {self.kv_cache_layout!r}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.kv_cache_memory_mib is not None and self.kv_cache_memory_mib <= 0:
            raise ValueError(f"--kv-cache-memory must be > 0 MiB, got {self.kv_cache_memory_mib}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(slots=True)
class SchedulerConfig:
    """Batching limits."""

    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int = 8192  # tokens computed per step (decodes + prefill chunks)
    max_prefill_chunk: int = 8192  # longest prefill chunk of one sequence in one step
    max_waiting_requests: int = 1024  # beyond this, new requests get RESOURCE_EXHAUSTED
    # "fcfs": waiting requests in arrival order; "priority": lowest `priority` value first (FCFS among
    # equals), and preemption takes the running request of the highest value (vLLM's --scheduling-policy).
    policy: str = "fcfs"

    def __post_init__(self):
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be fcfs or priority, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                f"--max-num-seqs ({self.max_num_seqs}) so every running sequence can decode each step"
            )


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to load a model and run it."""

    # GGUF file or HF folder; None = the embedded SmolLM2. A hub id (org/name) is downloaded by the CLI
    # (`model/hub.py`) before this config is built, so here it is always local.
    model: str | None = None
    served_model_name: str | None = None
    device: str = "auto"  # "cpu", "cuda", "cuda:N" or "auto"
    dtype: str = "auto"  # "float32", "bfloat16", "float16" or "auto" (fp32 on CPU, bf16 on GPU)
    max_model_len: int | None = None  # defaults to the model's context length
    yarn_scaling_factor: float | None = None
    seed: int = 0
    # Pooling of embeddings ("mean", "cls", "last", "max"); None = the model's sentence-transformers
    # configuration, else last-token for decoders.
    embedding_pooling: str | None = None
    load_format: str = "auto"  # "auto" (read the checkpoint) or "dummy" (random weights for a config.json)
    # Expand quantized GGUF weights at load instead of running them in their blocks (CPU, float32).
    dequantize: bool = False
    # In-situ quantization of a 16-bit checkpoint's projections at load: one of IN_SITU_QUANTIZATIONS or None.
    quantization: str | None = None
    attention_backend: str = "auto"  # "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton"
    enforce_eager: bool = False  # no CUDA graphs: every step launches its kernels one by one
    # Largest decode batch captured as a CUDA graph (larger ones run eagerly); None = --max-num-seqs, so every
    # decode step the scheduler can form replays a graph. Read it through `cuda_graph_batch_size`.
    max_cuda_graph_batch_size: int | None = None
    # A whole fresh prompt up to this many tokens replays a captured prefill graph (0: prefills run eagerly).
    max_prefill_graph_tokens: int = 2048
    # Schedule and launch step N+1 before waiting for step N; None = on for CUDA, off on the CPU
    # (where the model runs in the calling thread, so nothing would overlap).
    async_scheduling: bool | None = None
    chat_template: str | None = None  # a Jinja file replacing the model's own chat template
    # Ranks (one process and device each) the model is split over (`distributed/`); 1 = no split.
    tensor_parallel_size: int = 1
    # Leave every all-reduce to NCCL: no symmetric-memory path for a decode step's small ones.
    disable_custom_all_reduce: bool = False
    # Sampling defaults for fields a request leaves unset (`engine/generation_config.py`): "auto" = the
    # checkpoint's generation_config.json (GGUF: general.sampling.*), "none" = the API's, or a folder path.
    generation_config: str = "auto"
    # Laid over those defaults: generation_config.json keys (temperature, max_new_tokens, ...) -> values.
    override_generation_config: dict = field(default_factory=dict)
    profile_dir: str | None = None  # torch.profiler of engine steps `profile_steps` (start, count) -> this folder
    profile_steps: tuple[int, int] = (16, 16)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self):
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be auto, float32 (float), bfloat16 or float16 (half), got {self.dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+(,\d+)*", self.device)):
            raise ValueError(f"--device must be auto, cpu, cuda, cuda:N or cuda:N,M,..., got {self.device!r}")
        num_listed = self.device.count(",") + 1 if self.device.startswith("cuda:") else None
        if num_listed is not None and num_listed != self.tensor_parallel_size:
            raise ValueError(f"--device {self.device} names {num_listed} GPUs for --tensor-parallel-size "
                             f"{self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.yarn_scaling_factor is not None and self.yarn_scaling_factor <= 1.0:
            raise ValueError(f"--yarn-scaling-factor must be > 1, got {self.yarn_scaling_factor}")
        if self.embedding_pooling not in (None, "mean", "cls", "last", "max"):
            raise ValueError(f"--embedding-pooling must be mean, cls, last or max, got {self.embedding_pooling!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"--load-format must be auto or dummy, got {self.load_format!r}")
        if self.load_format == "dummy" and not self.model:
            raise ValueError("--load-format dummy needs --model naming a folder with a config.json")
        if self.quantization is not None and self.quantization not in IN_SITU_QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(IN_SITU_QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.quantization is not None and self.dequantize:
            raise ValueError("--quantization and --dequantize contradict each other: give one")
        if self.max_prefill_graph_tokens < 0:
            raise ValueError(f"--max-prefill-graph-tokens must be >= 0, got {self.max_prefill_graph_tokens}")
        if self.max_cuda_graph_batch_size is not None and self.max_cuda_graph_batch_size < 1:
            raise ValueError(f"--max-cuda-graph-batch-size must be >= 1, got {self.max_cuda_graph_batch_size}")
        if self.profile_steps[0] < 0 or self.profile_steps[1] < 1:
            raise ValueError(f"--profile-steps START:COUNT needs START >= 0 and COUNT >= 1, got {self.profile_steps}")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template: no such file {self.chat_template!r}")
        if self.generation_config not in ("auto", "none") and not os.path.isdir(self.generation_config):
            raise ValueError(f"--generation-config must be auto, none or a folder, got {self.generation_config!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"--attention-backend must be auto, torch or triton, got {self.attention_backend!r}")

    @property
    def cuda_graph_batch_size(self) -> int:
        """The largest decode batch to capture: the flag, capped at --max-num-seqs (no step is larger)."""
        limit = self.max_cuda_graph_batch_size or self.scheduler.max_num_seqs
        return min(limit, self.scheduler.max_num_seqs)


@dataclass(slots=True)
class ServerConfig:
    """The gRPC server around the engine."""

    host: str = "127.0.0.1"  # loopback unless told otherwise: the chart passes 0.0.0.0
    port: int = 50051
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None = off
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM
    # Largest gRPC message. Above the proxy's default body limit (8 MiB), far below what would let one
    # request hold gigabytes while it is decoded and checked.
    max_message_mib: int = 16
    keepalive_time_s: float = 30.0
    # A Generate stream whose client has not read a response for this long, or lets more than
    # `max_queued_responses` wait, gets its requests aborted (RESOURCE_EXHAUSTED) and their KV blocks freed.
    max_stream_stall_s: float = 30.0
    max_queued_responses: int = 65536
    api_key: str | None = None  # calls must carry `authorization: Bearer <key>` (health checks excepted)
    tls_cert: str | None = None  # PEM files; both set: TLS
    tls_key: str | None = None
    tls_ca: str | None = None  # set: mutual TLS, clients need a certificate this CA signed
    # The engine core (scheduler, model runner, output processing) runs in a process of its own unless set:
    # then on a thread of the gRPC process (tests and benchmarks that look inside the engine).
    engine_in_process: bool | None = None  # None: in process on the CPU, a process of its own elsewhere

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_message_mib < 1:
            raise ValueError(f"--max-message-size must be >= 1 MiB, got {self.max_message_mib}")
        if not self.max_stream_stall_s > 0:
            raise ValueError(f"--max-stream-stall must be > 0 seconds, got {self.max_stream_stall_s}")
        if self.max_queued_responses < 1:
            raise ValueError(f"--max-queued-responses must be >= 1, got {self.max_queued_responses}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-ca (mutual TLS) needs --tls-cert and --tls-key")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag}: no such file {path!r}")
