"""`inference-service serve ...`: the one place that turns command-line flags into configs."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from dataclasses import MISSING, fields, replace

from inference_service.config import (
    IN_SITU_QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    ServerConfig,
)
from inference_service.engine.generation_config import parse_override
from inference_service.model.hub import HubError, download_model, parse_hub_id

API_KEY_ENV = "INFERENCE_SERVICE_API_KEY"


def _default(config_class, name: str):
    """The dataclass's own default of field `name`: the CLI, `bench/` and library callers share one set of defaults,
    so a number measured with an engine built in-process is what `serve` gives with the same flags."""
    f = next(f for f in fields(config_class) if f.name == name)
    assert f.default is not MISSING, name
    return f.default


def _steps_window(text: str) -> tuple[int, int]:
    start, sep, count = text.partition(":")
    if not sep or not start.isdigit() or not count.isdigit():
        raise argparse.ArgumentTypeError(f"expected START:COUNT (two integers), got {text!r}")
    return int(start), int(count)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inference-service", description="LLM inference engine over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "serve", help="serve a model over gRPC", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve a model over gRPC (InferenceService, grpc.health.v1, server reflection).",
    )
    _add_model_args(p)
    _add_cache_and_scheduler_args(p)
    _add_server_args(p)
    return parser


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model to load and how: path or hub id, dtype, device, quantization."""
    m = p.add_argument_group("model")
    m.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face safetensors folder (decoder, or BERT encoder for embeddings only), "
                        "all-minilm-l6-v2, or a Hugging Face Hub id org/name[@revision][:QUANT] downloaded into "
                        "the hub cache (HF_TOKEN, HF_HUB_OFFLINE honoured); default: the embedded "
                        "SmolLM2-135M-Instruct")
    m.add_argument("--revision", default=None,
                   help="hub revision (branch, tag or commit) of a hub --model; default main (or its @revision)")
    m.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="the GGUF file to load from a hub --model repo holding several (else: its :QUANT hint)")
    m.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                   help="name clients use (one); default: the hub id, else derived from the model")
    m.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    m.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "float", "bfloat16", "float16", "half", "fp32", "bf16", "fp16"],
                   help="auto (float32 on CPU, bfloat16 on GPU), float32 (float), bfloat16, float16 (half)")
    m.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N devices, one process each (rank 0 serves; NCCL on GPUs, "
                        "gloo on the CPU); --device cuda takes GPUs 0..N-1, --device cuda:2,3 those")
    m.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="with --tensor-parallel-size > 1 on GPUs: every all-reduce through NCCL (by default a "
                        "decode step's small ones go through PyTorch symmetric memory over NVLink)")
    m.add_argument("--dequantize", action="store_true",
                   help="expand a GGUF's Q4_0/Q4_1/Q8_0 weights to --dtype at load; by default they stay in their "
                        "blocks on a CPU and run in place (a fifth to a quarter of the memory read per token)")
    m.add_argument("--quantization", "-q", default=None, choices=IN_SITU_QUANTIZATIONS,
                   help="quantize a 16-bit checkpoint's projections at load (fp8 e4m3 per channel, int8 per "
                        "channel, int4 group 128, q4_k as GGUF's Q4_K: 4-bit codes with a scale and a min per 32 "
                        "under super-block scales; GPU kernels). GPTQ/AWQ/compressed-tensors/fp8 checkpoints "
                        "load quantized without it")
    m.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights for the architecture in --model's config.json (benchmarks)")
    m.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton kernels on CUDA, plain torch elsewhere")
    m.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs on a GPU: run every decode step eagerly (slower; for debugging)")
    m.add_argument("--max-cuda-graph-batch-size", type=int,
                   default=_default(EngineConfig, "max_cuda_graph_batch_size"),
                   help="largest decode batch captured as a CUDA graph; larger ones run eagerly (default: "
                        "--max-num-seqs, so every decode step replays a graph; captured sizes 1, 2, 4, 8, 16, ... "
                        "8 apart below 256 and 16 apart above)")
    m.add_argument("--max-prefill-graph-tokens", type=int, default=_default(EngineConfig, "max_prefill_graph_tokens"),
                   metavar="N",
                   help="a whole fresh prompt of up to N tokens (when it is a step alone) replays a CUDA graph "
                        "captured at start-up, lengths 128 apart, instead of launching each kernel: the time to "
                        "first token of short prompts is the GPU's, not the host's; 0 = eager prefills")
    m.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the previous one's tokens reach the host, so scheduling and "
                        "output processing overlap the GPU (default: on with CUDA, off on the CPU)")
    m.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="write a torch.profiler trace (Chrome/Perfetto JSON) and a table of the top operators of "
                        "the engine steps --profile-steps to DIR, from the process that runs them")
    m.add_argument("--profile-steps", type=_steps_window, default=_default(EngineConfig, "profile_steps"),
                   metavar="START:COUNT",
                   help="which engine steps --profile-dir records, counting steps that launched work from 0 "
                        "(default 16:16)")
    m.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template replacing the model's own (as vLLM's --chat-template)")
    m.add_argument("--generation-config", default="auto", metavar="auto|none|FOLDER",
                   help="sampling defaults for fields a request leaves unset: auto = the checkpoint's "
                        "generation_config.json (a GGUF: its general.sampling.* metadata), none = the OpenAI "
                        "API's defaults, or a folder holding a generation_config.json (as vLLM)")
    m.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="JSON object laid over those defaults (as vLLM), e.g. "
                        "'{\"temperature\": 0.5, \"max_new_tokens\": 256, \"repetition_penalty\": 1.1}'; "
                        "keys: temperature, top_p, top_k, min_p, repetition_penalty, frequency_penalty, "
                        "presence_penalty, max_new_tokens (= max_tokens)")
    m.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                   help="max_tokens of requests that set none (the same as overriding max_new_tokens); "
                        "default: up to the end of the context window")
    m.add_argument("--max-model-len", type=int, default=None, help="context length; default: the model's")
    m.add_argument("--yarn-scaling-factor", type=float, default=None,
                   help="turn on YaRN rope scaling with this factor (extends the context by that much)")
    m.add_argument("--seed", type=int, default=0, help="seed of the engine's shared random generator")
    m.add_argument("--embedding-pooling", default=None, choices=["mean", "cls", "last", "max"],
                   help="pooling of Embed; default: the model's sentence-transformers config, else last token")


def _add_cache_and_scheduler_args(p: argparse.ArgumentParser) -> None:
    """The paged KV cache and the continuous-batching scheduler."""
    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    c.add_argument("--kv-cache-memory", type=int, default=None, dest="kv_cache_memory_mib",
                   help="KV-cache size in MiB; default 1024 on CPU, --gpu-memory-fraction on a GPU")
    c.add_argument("--gpu-memory-fraction", type=float, default=None,
                   help="fraction of the GPU memory free after loading the model given to the KV cache, less "
                        "the profiled activation peaks of the largest prefill step and CUDA graph (default 0.9)")
    c.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM's meaning, instead of --gpu-memory-fraction: fraction of the GPU's TOTAL memory "
                        "this engine may use in all; the KV cache gets it less what is in use after loading "
                        "(weights, other processes) and the activation peaks")
    c.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp16", "float16"],
                   help="auto: the model dtype; fp8 (= fp8_e4m3): half the memory and bytes read, Triton only; "
                        "fp16 (= float16): half a float32 model's, the CPU backend only")
    c.add_argument("--kv-cache-layout", default="auto", choices=["auto", "nhd", "hnd"],
                   help="memory order of a cache block: hnd = each KV head's tokens contiguous (what the GPU's "
                        "decode attention streams fastest), nhd = token by token (what the CPU kernels read); "
                        "auto: hnd for the Triton attention backend, nhd for the CPU one")
    c.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV blocks between requests with identical prompt prefixes")
    c.add_argument("--no-prefix-caching", action="store_false", dest="enable_prefix_caching",
                   help="the same as --no-enable-prefix-caching")
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=int, default=_default(SchedulerConfig, "max_num_seqs"),
                   help="most sequences running at once")
    s.add_argument("--max-num-batched-tokens", type=int, default=_default(SchedulerConfig, "max_num_batched_tokens"),
                   help="token budget of one step")
    s.add_argument("--prefill-chunk-size", type=int, default=_default(SchedulerConfig, "max_prefill_chunk"),
                   dest="max_prefill_chunk", help="longest prefill chunk of one sequence in one step (chunked prefill)")
    s.add_argument("--max-waiting-requests", type=int, default=_default(SchedulerConfig, "max_waiting_requests"),
                   help="waiting-queue bound; beyond it new requests get RESOURCE_EXHAUSTED")
    s.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: waiting requests in arrival order (a request's priority is ignored); priority: "
                        "the lowest priority value first, arrival order among equals (as vLLM)")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """The gRPC server, its limits and its security."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface; then set --api-key and TLS)")
    g.add_argument("--port", type=int, default=50051, help="gRPC port (0 picks a free one)")
    g.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics over HTTP on this port")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--max-message-size", type=int, default=16, dest="max_message_mib",
                   help="largest gRPC message in MiB (larger ones are refused with RESOURCE_EXHAUSTED)")
    g.add_argument("--max-stream-stall", type=float, default=30.0, dest="max_stream_stall_s",
                   help="seconds a Generate stream's client may leave a response unread before the stream's "
                        "requests are aborted (RESOURCE_EXHAUSTED) and their KV blocks freed")
    g.add_argument("--max-queued-responses", type=int, default=65536,
                   help="responses a Generate stream may hold unread by its client before its requests are aborted")
    core = g.add_mutually_exclusive_group()
    core.add_argument("--engine-in-process", dest="engine_in_process", action="store_const", const=True,
                      default=None, help="run the engine core on a thread of the gRPC server's process (the "
                                         "default on the CPU, where it measures faster: docs/operations.md)")
    core.add_argument("--engine-core-process", dest="engine_in_process", action="store_const", const=False,
                      help="run the engine core in a process of its own (the default on GPUs)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    a = p.add_argument_group("security")
    a.add_argument("--api-key", default=None,
                   help=f"require the metadata `authorization: Bearer KEY` on every call but grpc.health.v1 "
                        f"(default: ${API_KEY_ENV}; unset: no auth)")
    a.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate (chain)")
    a.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    a.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="mutual TLS: require client certificates signed by this CA")


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    served_names = args.served_model_name or []
    if len(served_names) > 1:
        raise ValueError(f"--served-model-name: one name only (aliases are not supported), got {served_names}")
    if args.gpu_memory_fraction is not None and args.gpu_memory_utilization is not None:
        raise ValueError("--gpu-memory-fraction (of free memory) and --gpu-memory-utilization (of total memory, "
                         "vLLM's meaning) are two ways to size the KV cache: give one")
    hub_model = parse_hub_id(args.model, args.revision)
    if hub_model is None and (args.revision is not None or args.gguf_file is not None):
        raise ValueError("--revision and --gguf-file apply to a hub --model (org/name), not to a local path")
    engine = EngineConfig(
        model=args.model,
        served_model_name=served_names[0] if served_names else (hub_model.repo_id if hub_model else None),
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        yarn_scaling_factor=args.yarn_scaling_factor,
        seed=args.seed,
        embedding_pooling=args.embedding_pooling,
        load_format=args.load_format,
        dequantize=args.dequantize,
        quantization=args.quantization,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        max_cuda_graph_batch_size=args.max_cuda_graph_batch_size,
        max_prefill_graph_tokens=args.max_prefill_graph_tokens,
        async_scheduling=args.async_scheduling,
        chat_template=args.chat_template,
        profile_dir=args.profile_dir,
        profile_steps=args.profile_steps,
        tensor_parallel_size=args.tensor_parallel_size,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
        generation_config=args.generation_config,
        override_generation_config=_override_generation_config(args),
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_mib=args.kv_cache_memory_mib,
            gpu_memory_fraction=0.9 if args.gpu_memory_fraction is None else args.gpu_memory_fraction,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_layout=args.kv_cache_layout,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_prefill_chunk=args.max_prefill_chunk,
            max_waiting_requests=args.max_waiting_requests,
            policy=args.scheduling_policy,
        ),
    )
    server = ServerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        shutdown_timeout=args.shutdown_timeout,
        max_message_mib=args.max_message_mib,
        max_stream_stall_s=args.max_stream_stall_s,
        max_queued_responses=args.max_queued_responses,
        engine_in_process=args.engine_in_process,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
    )
    return engine, server


def _override_generation_config(args: argparse.Namespace) -> dict:
    override = parse_override(args.override_generation_config)
    if args.default_max_tokens is not None:
        if args.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
        if {"max_tokens", "max_new_tokens"} & set(override):
            raise ValueError("--default-max-tokens and --override-generation-config's max_new_tokens both set "
                             "the default max_tokens: give one")
        override["max_new_tokens"] = args.default_max_tokens
    return override


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        engine_config, server_config = configs_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    hub_model = parse_hub_id(args.model, args.revision)
    if hub_model is not None:
        try:
            engine_config = replace(engine_config, model=download_model(hub_model, args.gguf_file))
        except HubError as e:
            logging.getLogger("inference_service").error("cannot start: %s", e)
            sys.exit(2)
    import torch

    from inference_service.server import serve

    torch.manual_seed(engine_config.seed)
    try:
        exit_code = asyncio.run(serve(engine_config, server_config))
    except (ValueError, FileNotFoundError, OSError) as e:
        logging.getLogger("inference_service").error("cannot start: %s", e)
        sys.exit(2)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
