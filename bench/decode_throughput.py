"""Decode throughput of the embedded model on this CPU: ours through the real gRPC API, beside llama.cpp
and Hugging Face transformers on the same GGUF and prompts, in one run.

One run measures:
  * the copy bandwidth of a large tensor copy, and from it the memory-bandwidth bound of batch-1 decode
    (bandwidth / bytes of weights read per step), for the weights in their blocks and expanded;
  * our engine as `serve` ships it (GGUF weights executed in their blocks) and with `--dequantize`
    (expanded to float32 at load), each through gRPC: batch 1 over PROMPTS (greedy, NEW_TOKENS each),
    and CONCURRENCY requests at once; the engine process's resident memory;
  * llama.cpp (llama-cpp-python, 2 threads) on the same GGUF and the same prompt token ids, installed
    by this script into its own virtualenv (bench/.llama-cpp-venv) on first use;
  * HF transformers `generate` (fp32: it dequantizes the GGUF), the token-exact reference: each system's
    greedy tokens are compared with it prompt by prompt.
Decode rates count every token after each request's first (prefill produced that one) over the time
from first to last token.

Usage: python bench/decode_throughput.py [--new-tokens 48] [--skip-llama-cpp] [--skip-hf] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import grpc
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from inference_service.api import pb, pb_grpc  # noqa: E402
from inference_service.model.loader import default_model_path, load_model  # noqa: E402
from tests.grpc_client import start_engine  # noqa: E402

LLAMA_CPP_VENV = os.path.join(REPO, "bench", ".llama-cpp-venv")
# A native build of llama.cpp segfaults at decode on these machines; this instruction set does not.
LLAMA_CPP_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
CHATS = [
    "What is the capital of France?", "List three prime numbers.", "Write a haiku about the sea.",
    "Explain recursion in one sentence.", "Give me a recipe for pancakes.", "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.", "Write a limerick about a cat.",
    "How do vaccines work?", "Summarize the plot of Romeo and Juliet.",
]
RAW = [
    "def fibonacci(n):\n    ", "The quick brown fox", "Once upon a time, in a land far away,",
    "Les bases de données relationnelles", "SELECT name, COUNT(*) FROM", "The three laws of thermodynamics are",
]


def prompt_ids(tok) -> list[list[int]]:
    """The 16 prompts as token ids (10 chat-templated, 6 raw), so every system reads the same tokens."""
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False)
             for c in CHATS]
    return chats + [tok.encode(text) for text in RAW]


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


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def generate(stub, request_id: str, ids: list[int], new_tokens: int) -> tuple[list[int], float, float, float]:
    """(tokens, start, first-token time, last-token time) of one greedy request on its own stream."""
    start = pb.StartGeneration(request_id=request_id, token_ids=pb.TokenIds(ids=ids),
                               sampling=pb.SamplingParams(temperature=0.0),
                               stopping=pb.StoppingCriteria(max_tokens=new_tokens, ignore_eos=True))
    tokens, first, last = [], None, None
    t0 = time.perf_counter()
    for response in stub.Generate(iter([pb.GenerateRequest(start=start)])):
        if response.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens.extend(response.token_ids)
    return tokens, t0, first, last


def measure_engine(flags: list[str], prompts: list[list[int]], new_tokens: int, concurrency: int) -> dict:
    log = os.path.join(tempfile.mkdtemp(), "engine.log")
    engine = start_engine("--kv-cache-memory", "512", *flags, log_path=log)
    try:
        with grpc.insecure_channel(engine.target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            generate(stub, "warmup", prompts[0], 8)
            results = [generate(stub, f"p{i}", ids, new_tokens) for i, ids in enumerate(prompts)]
            decode_tokens = sum(len(r[0]) - 1 for r in results)
            decode_time = sum(r[3] - r[2] for r in results)
            batch1 = {"tok_s": decode_tokens / decode_time,
                      "ttft_ms": 1000 * sum(r[2] - r[1] for r in results) / len(results),
                      "tokens": [r[0] for r in results]}
            concurrent: list = [None] * concurrency

            def one(i: int) -> None:
                concurrent[i] = generate(stub, f"c{i}", prompts[i % len(prompts)], 128)

            for rounds in range(2):  # the first round warms up the batched shapes
                threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            window = max(r[3] for r in concurrent) - min(r[2] for r in concurrent)
            batched = {"tok_s": sum(len(r[0]) - 1 for r in concurrent) / window}
        return {"batch1": batch1, "concurrent": batched, "rss_mib": rss_mib(engine.process.pid)}
    finally:
        engine.stop()


def hf_reference(prompts: list[list[int]], new_tokens: int) -> dict:
    import transformers

    path = default_model_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.utils.logging.disable_progress_bar()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    model.eval()
    tokens, decode_time = [], 0.0
    with torch.inference_mode():
        for ids in prompts:
            out = model(torch.tensor([ids]), use_cache=True)
            seq = [int(out.logits[0, -1].argmax())]
            start = time.perf_counter()
            for _ in range(new_tokens - 1):
                out = model(torch.tensor([[seq[-1]]]), past_key_values=out.past_key_values, use_cache=True)
                seq.append(int(out.logits[0, -1].argmax()))
            decode_time += time.perf_counter() - start
            tokens.append(seq)
    return {"tok_s": len(prompts) * (new_tokens - 1) / decode_time, "tokens": tokens}


_LLAMA_CPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, new_tokens, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_ctx=1024, n_threads=2, n_threads_batch=2, verbose=False)
def run(ids, n):
    seq, first = [], None
    llm.reset()  # a prompt whose prefix is cached would otherwise reuse that state (and differ from a fresh run)
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        now = time.perf_counter()
        first = first or now
        seq.append(int(token))
        if len(seq) == n:
            return seq, now - first
run(prompts[0], 8)
results = [run(ids, new_tokens) for ids in prompts]
print(json.dumps({"tok_s": sum(len(s) - 1 for s, _ in results) / sum(t for _, t in results),
                  "tokens": [s for s, _ in results]}))
"""


def llama_cpp(prompts: list[list[int]], new_tokens: int) -> dict:
    python = os.path.join(LLAMA_CPP_VENV, "bin", "python")
    if not os.path.exists(python):
        print("building llama-cpp-python into bench/.llama-cpp-venv (several minutes, once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", LLAMA_CPP_VENV], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "llama-cpp-python"], check=True,
                       env={**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE_ARGS})
    version = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    out = subprocess.run([python, "-c", _LLAMA_CPP_SCRIPT, default_model_path(), str(new_tokens)],
                         input=json.dumps(prompts), capture_output=True, text=True, check=True)
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "version": version}


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(tokens, reference, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    packed = load_model(None)
    prompts = prompt_ids(packed.tokenizer)
    packed_bytes = packed.model.num_weight_bytes
    del packed
    copied = copy_bandwidth_gbs()
    dense_bytes = load_model(None, quantized_weights=False).model.num_weight_bytes
    results = {"copy_gb_s": copied, "packed_weight_bytes": packed_bytes, "dense_weight_bytes": dense_bytes,
               "ours": measure_engine([], prompts, args.new_tokens, args.concurrency),
               "ours_dequantized": measure_engine(["--dequantize"], prompts, args.new_tokens, args.concurrency)}
    if not args.skip_llama_cpp:
        results["llama_cpp"] = llama_cpp(prompts, args.new_tokens)
    if not args.skip_hf:
        results["hf"] = hf_reference(prompts, args.new_tokens)

    ours, dense = results["ours"], results["ours_dequantized"]
    llama, hf = results.get("llama_cpp"), results.get("hf")
    reference = hf["tokens"] if hf else None

    def agree(tokens: list[list[int]]) -> str:
        return f"{agreement(tokens, reference)}/{len(prompts)}" if reference else "-"

    def vs_llama(rate: float) -> str:
        return f"{rate / llama['tok_s']:.2f}x" if llama else "-"

    print(f"\n{len(prompts)} prompts x {args.new_tokens} greedy tokens; copy bandwidth {copied:.1f} GB/s copied; "
          f"weights read per step: {packed_bytes / 1e6:.0f} MB in blocks, {dense_bytes / 1e6:.0f} MB expanded; "
          f"torch threads {torch.get_num_threads()}\n")
    print("| system | batch-1 decode tok/s | vs llama.cpp | bound (copy GB/s / bytes a step) | greedy = HF fp32 "
          f"| {args.concurrency} concurrent tok/s (x batch 1) | RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, run, step_bytes in (("ours, gRPC (default: weights in blocks)", ours, packed_bytes),
                                  ("ours, gRPC, --dequantize (float32)", dense, dense_bytes)):
        b1, bn = run["batch1"]["tok_s"], run["concurrent"]["tok_s"]
        print(f"| {name} | {b1:.1f} | {vs_llama(b1)} | {copied * 1e9 / step_bytes:.0f} "
              f"| {agree(run['batch1']['tokens'])} | {bn:.1f} ({bn / b1:.1f}x) | {run['rss_mib']:.0f} |")
    if llama:
        print(f"| llama.cpp {llama['version']} (llama-cpp-python, 2 threads) | {llama['tok_s']:.1f} | 1.00x | "
              f"| {agree(llama['tokens'])} | | |")
    if hf:
        print(f"| HF transformers fp32 (reference) | {hf['tok_s']:.1f} | {vs_llama(hf['tok_s'])} | | - | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
