"""The engine on a CUDA GPU: correctness against the CPU engine and HF transformers, then decode speed.

Sections (each runs even if an earlier one failed; results in `--out`/gpu_engine.json and a table last):
  correctness  (needs the SmolLM2 GGUF, `--smol PATH`)
    fp32:  greedy tokens of the GPU engine (Triton attention) == the CPU engine's (torch attention),
           both computed here, same prompts; first divergence reported per prompt.
    bf16:  logits of our model vs HF transformers bf16 on the same GPU, teacher-forced over HF's greedy
           continuation (prefill then one decode step a token, so both attention kernels are covered):
           relative error ||ours - hf|| / ||hf|| per position and overall, first argmax divergence;
           plus both engines' own greedy outputs and their first divergence.
  fallback     (always): the fp32 GPU-vs-CPU token check on Qwen2.5-0.5B dummy weights.
  decode       Llama-3-8B bf16 dummy weights, batch 1, 128-token prompt, 512 new tokens: decode tok/s
               vs the roofline = copy bandwidth (measured here) / weight bytes read per step.
  offline      Llama-3-8B bf16 dummy, N requests of 1000 random prompt tokens, 1000 output tokens
               (ignore_eos): output tokens/s.

Usage: python bench/gpu_engine.py --out DIR [--smol SmolLM2.gguf] [--skip decode,offline] [--offline-requests N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prometheus_client import CollectorRegistry  # noqa: E402

from inference_service.attention.metadata import AttentionMetadata  # noqa: E402
from inference_service.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from inference_service.engine.llm_engine import LLMEngine  # noqa: E402
from inference_service.engine.sampling_params import SamplingParams  # noqa: E402
from inference_service.metrics import EngineMetrics  # noqa: E402
from inference_service.model.linear import Linear  # noqa: E402
from inference_service.model.loader import load_model  # noqa: E402

DEVICE = "cuda"  # --device cpu: a dry run of the whole script on the CPU (checks the script, not the GPU)
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a",
    "Photosynthesis is the process by which plants",
    "1, 2, 3,",
]


# ---------------------------------------------------------------------------------------------- helpers

def make_engine(model: str | None, device: str, dtype: str, *, load_format: str = "auto", kv_mib: int | None = 2048,
                gpu_fraction: float = 0.9, loaded=None, **scheduler) -> LLMEngine:
    config = EngineConfig(model=model, device=device, dtype=dtype, load_format=load_format,
                          cache=CacheConfig(kv_cache_memory_mib=kv_mib, gpu_memory_fraction=gpu_fraction),
                          scheduler=SchedulerConfig(**scheduler))
    return LLMEngine(config, loaded=loaded, metrics=EngineMetrics("bench", registry=CollectorRegistry()))


def generate(engine: LLMEngine, prompts: list, params: SamplingParams) -> list[list[int]]:
    """All prompts at once; the output token ids of each."""
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.input_processor.process(f"r{i}", prompt, params))
        out[f"r{i}"] = []
    while engine.has_unfinished:
        for delta in engine.step():
            out[delta.request_id] += delta.token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where the sequences differ (length mismatch counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


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
        md = AttentionMetadata(
            slot_mapping=(table[0].long().repeat_interleave(block_size) * block_size
                          + torch.arange(block_size, device=device).repeat(num_blocks - 1))[start:end],
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=device), block_tables=table,
            max_query_len=end - start, max_seq_len=end, query_start_loc_cpu=[0, end - start], seq_lens_cpu=[end])
        hidden = model(ids[start:end], torch.arange(start, end, device=device), caches, md)
        logits.append(model.compute_logits(hidden[-1:]))
        start, end = end, end + 1
    return torch.cat(logits)


def sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


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
        if isinstance(module, Linear):
            total += module.in_features * module.out_features * model.dtype.itemsize
    for name, p in model.named_parameters():
        if "norm" in name or name.endswith(".bias"):
            total += p.numel() * p.element_size()
    return total


def hf_llama_from_gguf(path: str, dtype: torch.dtype = torch.bfloat16):
    """HF transformers' LlamaForCausalLM in bf16 on DEVICE holding the GGUF's weights, dequantized by our
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
    model = LlamaForCausalLM(hf_config).to(dtype=dtype, device=DEVICE).eval()
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
    gpu = make_engine(smol, DEVICE, "float32")
    results["attention_backend"] = gpu.loaded.model.attention_backend.name
    got = generate(gpu, prompts, params)
    div = [first_divergence(a, b) for a, b in zip(got, ref)]
    results["fp32_gpu_vs_cpu"] = {"equal": all(d is None for d in div), "first_divergence": div,
                                  "num_prompts": len(prompts), "max_tokens": max_tokens, "cpu_seconds": round(cpu_s, 2),
                                  "sample_text": gpu.tokenizer.decode(got[0])}
    print("fp32 GPU vs CPU:", results["fp32_gpu_vs_cpu"], flush=True)
    del cpu, gpu

    hf = hf_llama_from_gguf(smol)
    hf32 = hf_llama_from_gguf(smol, torch.float32)  # how far bf16 itself moves the logits, for scale
    ours_engine = make_engine(smol, DEVICE, "bfloat16")
    ours_model = ours_engine.loaded.model
    per_prompt = []
    ours_greedy = generate(ours_engine, prompts, params)
    for prompt, mine in zip(prompts, ours_greedy):
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.inference_mode():
            hf_out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                                 attention_mask=torch.ones_like(ids))[0].tolist()
            full = hf_out  # prompt + HF's greedy continuation
            hf_logits = hf(torch.tensor([full], device=DEVICE)).logits[0, len(prompt) - 1:].float()  # [N + 1, V]
            fp32_logits = hf32(torch.tensor([full], device=DEVICE)).logits[0, len(prompt) - 1:].float()
        our_logits = teacher_forced_logits(ours_model, full, len(prompt), DEVICE)
        diff = (our_logits - hf_logits).norm(dim=-1) / hf_logits.norm(dim=-1)  # [N + 1]
        argmax_div = (our_logits.argmax(-1) != hf_logits.argmax(-1)).nonzero()
        per_prompt.append({
            "rel_err": ((our_logits - hf_logits).norm() / hf_logits.norm()).item(),
            "rel_err_max_position": diff.max().item(),
            "first_argmax_divergence": int(argmax_div[0]) if len(argmax_div) else None,
            "greedy_first_divergence": first_divergence(mine, hf_out[len(prompt):]),
            "ours_bf16_vs_hf_fp32": ((our_logits - fp32_logits).norm() / fp32_logits.norm()).item(),
            "hf_bf16_vs_hf_fp32": ((hf_logits - fp32_logits).norm() / fp32_logits.norm()).item(),
        })
    worst = max(p["rel_err"] for p in per_prompt)
    results["bf16_vs_hf"] = {"per_prompt": per_prompt, "worst_rel_err": worst, "pass_2e-2": worst < 2e-2,
                             "hf_text": ours_engine.tokenizer.decode(hf_out[len(prompt):])}
    print("bf16 vs HF:", json.dumps(results["bf16_vs_hf"], indent=1), flush=True)
    del hf, hf32, ours_engine, ours_model
    if DEVICE != "cpu":
        torch.cuda.empty_cache()


def fallback_correctness(results: dict, max_tokens: int = 32) -> None:
    path = os.path.join(CONFIGS, "qwen2.5-0.5b")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[(7 * i + 13 * j) % 256 for j in range(20 + 9 * i)] for i in range(4)]
    got = generate(make_engine(path, DEVICE, "float32", load_format="dummy"), prompts, params)
    ref = generate(make_engine(path, "cpu", "float32", load_format="dummy", kv_mib=512), prompts, params)
    div = [first_divergence(a, b) for a, b in zip(got, ref)]
    results["dummy_qwen2.5_fp32_gpu_vs_cpu"] = {"equal": all(d is None for d in div), "first_divergence": div}
    print("dummy Qwen2.5-0.5B fp32 GPU vs CPU:", results["dummy_qwen2.5_fp32_gpu_vs_cpu"], flush=True)
    if DEVICE != "cpu":
        torch.cuda.empty_cache()


def decode_bench(results: dict, config: str, prompt_len: int = 128, new_tokens: int = 512) -> LLMEngine:
    t0 = time.perf_counter()
    engine = make_engine(os.path.join(CONFIGS, config), DEVICE, "bfloat16", load_format="dummy",
                         kv_mib=None if DEVICE != "cpu" else 1024, gpu_fraction=0.85)
    load_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128000, (prompt_len,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    generate(engine, [prompt[:32]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # compile
    engine.add_request(engine.input_processor.process("bench", prompt, params))
    sync()
    stamps = [time.perf_counter()]
    while engine.has_unfinished:
        engine.step()  # the sampler's .tolist() syncs once per step
        stamps.append(time.perf_counter())
    ttft = stamps[1] - stamps[0]
    decode_s = stamps[-1] - stamps[1]
    tok_s = (new_tokens - 1) / decode_s
    bw = copy_bandwidth_gbs()
    weight_bytes = weight_bytes_per_step(engine.loaded.model)
    roofline = bw * 1e9 / weight_bytes
    step_ms = sorted((b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:]))
    results["decode_bf16"] = {
        "model": config, "batch": 1, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "decode_tok_s": round(tok_s, 1),
        "ttft_ms": round(ttft * 1e3, 1), "step_ms_median": round(step_ms[len(step_ms) // 2], 3),
        "step_ms_p90": round(step_ms[int(len(step_ms) * 0.9)], 3), "copy_gbs": round(bw, 1),
        "weight_gb_per_step": round(weight_bytes / 1e9, 3), "roofline_tok_s": round(roofline, 1),
        "ratio_to_roofline": round(tok_s / roofline, 3), "load_seconds": round(load_s, 1),
        "kv_blocks": engine.model_runner.num_blocks, "target_tok_s": 170,
    }
    print("decode:", results["decode_bf16"], flush=True)
    return engine


def step_profile(engine: LLMEngine, results: dict, steps: int = 30) -> None:
    """Host time of one decode step vs the GPU time of the model forward inside it (batch 1)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    engine.add_request(engine.input_processor.process("prof", list(range(1, 129)), params))
    engine.step()  # prefill
    runner = engine.model_runner
    original = runner.model.forward
    gpu_ms, host_ms = [], []

    def timed_forward(*args, **kwargs):
        if DEVICE == "cpu":
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            timed_forward.events.append((time.perf_counter() - t0) * 1e3)
            return out
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = original(*args, **kwargs)
        b.record()
        timed_forward.events.append((a, b))
        return out

    timed_forward.events = []
    runner.model.forward = timed_forward
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            host_ms.append((time.perf_counter() - t0) * 1e3)
        sync()
        gpu_ms = sorted(e if DEVICE == "cpu" else e[0].elapsed_time(e[1]) for e in timed_forward.events)
    finally:
        runner.model.forward = original
    while engine.has_unfinished:
        engine.step()
    host_ms.sort()
    results["decode_step_profile"] = {"step_wall_ms_median": round(host_ms[len(host_ms) // 2], 3),
                                      "forward_gpu_ms_median": round(gpu_ms[len(gpu_ms) // 2], 3)}
    print("step profile:", results["decode_step_profile"], flush=True)


def offline_bench(engine: LLMEngine, results: dict, num_requests: int, prompt_len: int = 1000,
                  output_len: int = 1000, time_limit_s: float = 150.0) -> None:
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        prompt = torch.randint(0, 128000, (prompt_len,), generator=gen).tolist()
        engine.add_request(engine.input_processor.process(f"o{i}", prompt, params))
    t0 = time.perf_counter()
    num_out, steps = 0, 0
    while engine.has_unfinished and time.perf_counter() - t0 < time_limit_s:
        num_out += sum(len(d.token_ids) for d in engine.step())
        steps += 1
    elapsed = time.perf_counter() - t0
    finished = not engine.has_unfinished
    results["offline_bf16"] = {
        "model": engine.loaded.model_name, "requests": num_requests, "prompt_tokens": prompt_len, "output_tokens": output_len,
        "finished": finished, "elapsed_s": round(elapsed, 1), "output_tokens_done": num_out, "steps": steps,
        "output_tok_s": round(num_out / elapsed, 1), "target_tok_s": 7000,
        "kv_blocks": engine.model_runner.num_blocks, "max_num_seqs": engine.config.scheduler.max_num_seqs,
    }
    print("offline:", results["offline_bf16"], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_engine"))
    parser.add_argument("--smol", default=None, help="SmolLM2-135M-Instruct GGUF (correctness section)")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--offline-requests", type=int, default=128)
    parser.add_argument("--offline-lens", default="1000,1000", help="prompt,output tokens of each offline request")
    parser.add_argument("--decode-config", default="llama-3-8b", help="folder under bench/configs")
    parser.add_argument("--decode-lens", default="128,512", help="prompt,new tokens of the batch-1 decode run")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per correctness prompt")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    os.makedirs(args.out, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    results: dict = {"device": torch.cuda.get_device_name() if DEVICE != "cpu" else "cpu (dry run)", "torch": torch.__version__,
                     "commit": os.environ.get("COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    errors = {}

    def section(name, fn, *a):
        if name in skip:
            return None
        try:
            return fn(*a)
        except Exception:  # noqa: BLE001 - report and go on with the next section
            errors[name] = traceback.format_exc()
            print(f"[{name}] FAILED\n{errors[name]}", flush=True)
            return None
        finally:
            with open(os.path.join(args.out, "gpu_engine.json"), "w") as f:
                json.dump({**results, "errors": errors}, f, indent=1)

    if args.smol and os.path.isfile(args.smol):
        section("correctness", correctness, args.smol, results, args.max_tokens)
    else:
        results["correctness"] = f"skipped: no SmolLM2 GGUF at {args.smol!r}"
    section("fallback", fallback_correctness, results)
    engine = section("decode", decode_bench, results, args.decode_config, *map(int, args.decode_lens.split(",")))
    if engine is not None:
        section("profile", step_profile, engine, results)
        prompt_len, output_len = map(int, args.offline_lens.split(","))
        section("offline", offline_bench, engine, results, args.offline_requests, prompt_len, output_len)
    print(json.dumps({**results, "errors": list(errors)}, indent=1))


if __name__ == "__main__":
    main()
