"""Decode throughput of the embedded model on this CPU, through the real gRPC API.

One run measures, on the same machine and prompts:
  * the copy bandwidth of a large tensor copy, and from it the memory-bandwidth bound of batch-1
    decode, bandwidth / bytes of weights read per step, two ways: with the bandwidth as bytes copied
    per second (the issue's definition), and as bytes read + written per second (twice that: a
    stricter bound, since decode only reads);
  * our engine over gRPC at 1 and at 16 concurrent requests (decode tokens/s after the first token);
  * Hugging Face transformers `generate` (fp32, greedy, batch 1) on the same prompt.

Usage: python bench/decode_throughput.py [--new-tokens 128] [--skip-hf]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import warnings

import grpc
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference_service.api import pb, pb_grpc  # noqa: E402
from inference_service.model.loader import default_model_path, load_model  # noqa: E402
from tests.grpc_client import start_engine  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."


def copy_bandwidth_gbs(num_bytes: int = 512 * 2**20, repeats: int = 10) -> float:
    """Bytes copied per second (each byte is read once and written once), in GB/s."""
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step must read: every projection (the tied embedding counted once,
    as lm_head) and every norm. Counted from shapes: CPU linears keep their weights packed for oneDNN."""
    from inference_service.model.linear import Linear

    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            elem = torch.empty((), dtype=model.dtype).element_size()
            total += module.in_features * module.out_features * elem
            total += module.bias.numel() * elem if module.bias is not None else 0
        elif hasattr(module, "eps") and hasattr(module, "weight"):  # RMSNorm
            total += module.weight.numel() * module.weight.element_size()
    return total


def stream_decode_rate(target: str, num_requests: int, new_tokens: int) -> tuple[float, float]:
    """(aggregate decode tokens/s, mean time to first token) for concurrent requests on one stream each."""
    first, last, counts = {}, {}, {}
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)

        def one(i: int) -> None:
            start = pb.StartGeneration(
                request_id=f"r{i}", text=f"{PROMPT} (variant {i})",
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_tokens=new_tokens, ignore_eos=True),
            )
            t0 = time.perf_counter()
            for response in stub.Generate(iter([pb.GenerateRequest(start=start)])):
                now = time.perf_counter()
                if response.token_ids:
                    if i not in first:
                        first[i] = (t0, now)
                    last[i] = now
                    counts[i] = counts.get(i, 0) + len(response.token_ids)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(num_requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # Decode rate: every token after each request's first (which prefill produced), over the time
    # from the first first-token to the last token.
    tokens = sum(counts.values()) - num_requests
    window = max(last.values()) - min(f[1] for f in first.values())
    ttft = sum(f[1] - f[0] for f in first.values()) / num_requests
    return tokens / window, ttft


def hf_decode_rate(new_tokens: int) -> float:
    import transformers

    path = default_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ids = tok(PROMPT, return_tensors="pt")
    kwargs = dict(do_sample=False, pad_token_id=tok.eos_token_id)

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        return time.perf_counter() - start

    timed(4)  # warm up
    return (new_tokens - 1) / (timed(new_tokens) - timed(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()

    copied = copy_bandwidth_gbs()  # GB/s copied; the copy moves twice that in reads + writes
    loaded = load_model(None)
    step_bytes = weight_bytes_per_step(loaded.model)
    del loaded
    bound = copied * 1e9 / step_bytes  # the bound
    strict = 2 * bound  # bandwidth counted as bytes read + written

    log = os.path.join(tempfile.mkdtemp(), "engine.log")
    engine = start_engine("--kv-cache-memory", "512", log_path=log)
    try:
        # Warm up at both concurrencies: oneDNN builds its kernels for each new batch shape on first use.
        stream_decode_rate(engine.target, 1, 8)
        stream_decode_rate(engine.target, args.concurrency, 8)
        bs1, ttft1 = stream_decode_rate(engine.target, 1, args.new_tokens)
        bsn, ttftn = stream_decode_rate(engine.target, args.concurrency, args.new_tokens)
    finally:
        engine.stop()
    hf = None if args.skip_hf else hf_decode_rate(args.new_tokens)

    def of_bounds(rate: float) -> str:
        return f"{rate / bound:.2f} of copy bound, {rate / strict:.2f} of read+write bound"

    print(f"\ncopy bandwidth: {copied:.1f} GB/s copied = {2 * copied:.1f} GB/s read + written; "
          f"weights read per decode step: {step_bytes / 1e6:.0f} MB; torch threads: {torch.get_num_threads()}\n")
    print("| measurement | decode tok/s | ratio |")
    print("|---|---:|---|")
    print(f"| bandwidth bound, batch 1: {copied:.1f} GB/s copied / weights per step (issue's bound) "
          f"| {bound:.1f} | 1.00 of copy bound |")
    print(f"| bandwidth bound, batch 1: {2 * copied:.1f} GB/s read + written / weights per step (stricter) "
          f"| {strict:.1f} | 1.00 of read+write bound |")
    print(f"| ours, gRPC, 1 request (TTFT {ttft1 * 1000:.0f} ms) | {bs1:.1f} | {of_bounds(bs1)}"
          + (f", {bs1 / hf:.2f}x HF |" if hf else " |"))
    if hf:
        print(f"| HF transformers generate, batch 1 | {hf:.1f} | {of_bounds(hf)} |")
    print(f"| ours, gRPC, {args.concurrency} concurrent (aggregate; mean TTFT {ttftn * 1000:.0f} ms) | {bsn:.1f} "
          f"| {bsn / bs1:.1f}x ours at batch 1 |")


if __name__ == "__main__":
    main()
