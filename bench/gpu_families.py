"""Issue 20's "done when" on one GPU, with dummy weights (bench/configs): the newer families' speed
against their bandwidth rooflines.

  decode    batch 1, 128-token prompt, 512 new tokens, CUDA graphs: Qwen3-30B-A3B (target >= 300 tok/s),
            Gemma-2-9B and Phi-3-mini (target >= 0.85 of the roofline). Roofline = copy bandwidth
            (measured here) / bytes a step reads: every dense weight, of a mixture-of-experts layer
            the router and the k experts a token picks, and the KV cache at the mean context of the
            timed steps (model bandwidth utilization as it is usually defined: weights + KV cache).
            The weights-only ratio is reported beside it.
  offline   Qwen3-30B-A3B, N x (1000 in, 1000 out), fp8 KV cache, as many sequences at once as the KV
            cache holds: output tok/s and the ratio to the bytes-moved bound at that batch (weights of
            the experts a step's batch touches, expected over uniform routing, plus the KV cache read
            at the mean context, 1500 tokens).

Also reported: which decoder stack each model ran (fused, or eager where the fused stack lacks a
feature of the family).

Usage: python bench/gpu_families.py --out DIR [--only decode,offline] [--offline-requests 1000]
       python bench/gpu_families.py --smoke --out DIR   (tiny configs on the CPU: checks the script)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback

import torch

import gpu_common as common
import gpu_perf
from gpu_common import CONFIGS, copy_bandwidth_gbs, free_device_memory, make_engine, sync

from inference_service.engine.gc_heap import freeze_startup_heap
from inference_service.engine.sampling_params import SamplingParams
from inference_service.model.linear import LinearBase
from inference_service.model.loader import load_model
from inference_service.model.moe import SparseMoE

MODELS = {"qwen3-30b-a3b": 300.0, "gemma-2-9b": None, "phi-3-mini": None}  # name -> decode tok/s target
ROOFLINE_TARGET = 0.85
# --smoke: the same architectures shrunk to run on this CPU in seconds.
SMOKE_SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=512, moe_intermediate_size=32, num_experts=8,
                   max_position_embeddings=4096)


def active_bytes_per_step(model, batch: int = 1) -> int:
    """Bytes a decode step of `batch` tokens reads: every projection (lm_head included), norms and
    biases, one embedding row a token, and per mixture-of-experts layer the router and the experts
    the batch touches: E (1 - (1 - k/E)^batch) of them in expectation over uniform routing."""
    itemsize = model.dtype.itemsize
    total = sum(m.in_features * m.out_features * itemsize for m in model.modules() if isinstance(m, LinearBase))
    total += sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                 if "norm" in name or name.endswith(".bias"))
    total += batch * model.config.hidden_size * itemsize
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        experts = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** batch)
        per_expert = (moe.experts.gate_up_proj[0].numel() + moe.experts.down_proj[0].numel()) * itemsize
        total += int(experts * per_expert) + moe.gate.weight.numel() * itemsize
    return total


def _load(name: str, smoke_dir: str | None):
    path = os.path.join(CONFIGS, name)
    if smoke_dir:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        config.update({k: v for k, v in SMOKE_SIZES.items() if k in config or k == "head_dim"})
        if "sliding_window" in config and config["sliding_window"]:
            config["sliding_window"] = 24  # so the smoke run slides too
        path = os.path.join(smoke_dir, name)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
    dtype = torch.float32 if smoke_dir else torch.bfloat16
    t0 = time.perf_counter()
    loaded = load_model(path, device=common.DEVICE, dtype=dtype, load_format="dummy")
    return loaded, time.perf_counter() - t0


def _engine(loaded, **kwargs):
    kv_mib = None if common.DEVICE != "cpu" else 256
    dtype = "bfloat16" if loaded.model.dtype == torch.bfloat16 else "float32"
    engine = make_engine(loaded.model_path, common.DEVICE, dtype, load_format="dummy", loaded=loaded, kv_mib=kv_mib,
                         **kwargs)
    freeze_startup_heap()
    return engine


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode(name: str, loaded, results: dict, bandwidth_gbs: float, prompt_len: int, new_tokens: int) -> None:
    weight_bytes = active_bytes_per_step(loaded.model)
    # NOTE: the timed steps run from the second new token on; a step attends to its whole context (the windows
    # of these configs are longer than the bench's contexts, so none binds).
    mean_context = prompt_len + new_tokens / 2
    kv_bytes = int(mean_context * _kv_bytes_per_token(loaded.config, loaded.model.dtype.itemsize))
    step_bytes = weight_bytes + kv_bytes
    roofline = bandwidth_gbs * 1e9 / step_bytes
    engine = _engine(loaded)
    vocab = loaded.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    common.generate(engine, [_prompt(32, 9, vocab)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.add_request(engine.input_processor.process("bench", _prompt(prompt_len, 0, vocab), params))
    sync()
    stamps = [time.perf_counter()]
    while engine.has_unfinished:
        engine.step()
        stamps.append(time.perf_counter())
    tok_s = (new_tokens - 1) / (stamps[-1] - stamps[1])
    step_ms = sorted((b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:]))
    target = MODELS[name]
    results[f"{name}_decode"] = {
        "stack": "fused" if loaded.model.fused_kernels else "eager", "batch": 1, "prompt_tokens": prompt_len,
        "new_tokens": new_tokens, "decode_tok_s": round(tok_s, 1), "active_gb_per_step": round(weight_bytes / 1e9, 3),
        "kv_gb_per_step": round(kv_bytes / 1e9, 4), "roofline_tok_s": round(roofline, 1),
        "ratio_to_roofline": round(tok_s / roofline, 3),
        "ratio_to_weights_roofline": round(tok_s * weight_bytes / (bandwidth_gbs * 1e9), 3),
        "target": f">= {target} tok/s" if target else f">= {ROOFLINE_TARGET} of the roofline",
        "meets_target": bool(tok_s >= target if target else tok_s >= ROOFLINE_TARGET * roofline),
        "step_ms_median": round(step_ms[len(step_ms) // 2], 3), "ttft_ms": round((stamps[1] - stamps[0]) * 1e3, 1),
        "cuda_graphs": engine.model_runner.graphs is not None,
    }
    print(f"{name} decode:", results[f"{name}_decode"], flush=True)
    del engine
    free_device_memory()


def _kv_bytes_per_token(config, kv_itemsize: int) -> int:
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * kv_itemsize


def offline(name: str, loaded, results: dict, bandwidth_gbs: float, num_requests: int, prompt_len: int,
            output_len: int, time_limit_s: float) -> None:
    """The fp8-KV offline run at the batch whose 2000-token sequences all fit in the KV cache."""
    config = loaded.config
    per_seq = _kv_bytes_per_token(config, 1) * (prompt_len + output_len)
    if common.DEVICE == "cpu":
        batch = 4
    else:
        free, _ = torch.cuda.mem_get_info()
        # NOTE: the engine leaves room for activations and CUDA graphs; a quarter of the free memory
        # is kept back for them here, and the batch rounded down to a captured graph size.
        batch = max(8, min(512, int(free * 0.75 / per_seq)) // 8 * 8)
    gpu_perf._engine = _engine  # the offline section as gpu_engine.py runs it, on this model's engine
    gpu_perf._random_prompt = lambda n, seed: _prompt(n, seed, config.vocab_size)
    before = set(results)
    # The smoke run's torch attention has no fp8 cache: it keeps the model dtype (the bound still assumes fp8).
    kv_cache_dtype = "auto" if common.DEVICE == "cpu" else "fp8"
    gpu_perf.offline(loaded, results, num_requests, prompt_len=prompt_len, output_len=output_len,
                     kv_cache_dtype=kv_cache_dtype, max_num_seqs=batch, time_limit_s=time_limit_s)
    (key,) = set(results) - before
    run = results.pop(key)
    mean_context = prompt_len + output_len / 2
    step_bytes = active_bytes_per_step(loaded.model, batch) + batch * mean_context * _kv_bytes_per_token(config, 1)
    bound = batch * bandwidth_gbs * 1e9 / step_bytes
    results[f"{name}_offline_fp8_kv"] = {
        **{k: run[k] for k in ("requests", "max_num_seqs", "finished", "elapsed_s", "output_tokens_done",
                               "output_tok_s", "preemptions", "kv_blocks", "by_step_kind")},
        "bytes_per_step_gb": round(step_bytes / 1e9, 3), "bound_tok_s": round(bound, 1),
        "ratio_to_bound": round(run["output_tok_s"] / bound, 3),
    }
    print(f"{name} offline:", results[f"{name}_offline_fp8_kv"], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny configs on the CPU (checks the script)")
    parser.add_argument("--only", default="decode,offline")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--offline-requests", type=int, default=1000)
    parser.add_argument("--offline-time-limit", type=float, default=200.0)
    args = parser.parse_args()
    sections = set(args.only.split(","))
    if args.smoke:
        common.DEVICE = "cpu"
        prompt_len, new_tokens, off_prompt, off_out, num_requests = 16, 12, 24, 8, 6
    else:
        prompt_len, new_tokens, off_prompt, off_out, num_requests = 128, 512, 1000, 1000, args.offline_requests
    os.makedirs(args.out, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name() if common.DEVICE != "cpu" else "cpu (smoke)"}
    bandwidth = copy_bandwidth_gbs(2**26 if args.smoke else 2**30)
    results["copy_gbs"] = round(bandwidth, 1)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as smoke_dir:
        for name in args.models.split(","):
            try:
                loaded, load_s = _load(name, smoke_dir if args.smoke else None)
                results[f"{name}_load_s"] = round(load_s, 1)
                if "decode" in sections:
                    decode(name, loaded, results, bandwidth, prompt_len, new_tokens)
                if "offline" in sections and loaded.config.num_experts:
                    offline(name, loaded, results, bandwidth, num_requests, off_prompt, off_out,
                            args.offline_time_limit)
            except Exception:  # noqa: BLE001 - one model's failure must not hide the others' numbers
                results[f"{name}_error"] = traceback.format_exc()
                print(results[f"{name}_error"], flush=True)
            finally:
                loaded = None
                free_device_memory()
    results["total_s"] = round(time.perf_counter() - t_start, 1)
    with open(os.path.join(args.out, "gpu_families.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    print("\n| model | section | tok/s | bound tok/s | ratio | target met |\n|---|---|---|---|---|---|")
    for key, value in results.items():
        if isinstance(value, dict) and "decode_tok_s" in value:
            print(f"| {key[:-7]} | decode b1 ({value['stack']}) | {value['decode_tok_s']} | "
                  f"{value['roofline_tok_s']} | {value['ratio_to_roofline']} | {value['meets_target']} |")
        elif isinstance(value, dict) and "bound_tok_s" in value:
            print(f"| {key[:-15]} | offline fp8 KV x{value['max_num_seqs']} | {value['output_tok_s']} | "
                  f"{value['bound_tok_s']} | {value['ratio_to_bound']} | - |")


if __name__ == "__main__":
    main()
