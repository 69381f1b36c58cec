"""Engine step rate with and without sampling options that read the output history (penalties).

A decode step's sampling should cost the same whether or not a row of the batch has a repetition
penalty: the history lives on the device and no step waits for the one before it. This times
in-process `LLMEngine.step()` calls over decode steps, each case on fresh requests:

  none     every row greedy, no penalty
  penalty  the same, but one row has repetition_penalty 1.3

The CPU run (default: the embedded model, batch 16, 64 decode steps) checks the host's sampling cost;
the GPU run (issue 16's measure) uses 256 requests of a dummy-weight model and reports the ratio of
step rates, which should stay >= 0.95:

    python bench/sampling_overhead.py                                   # CPU, embedded model
    python bench/sampling_overhead.py --model llama-3-8b --device cuda  # bench/configs name: dummy weights
    python bench/sampling_overhead.py --model /path/to/hf/folder --device cuda --batch 256

Prints one JSON line per case and a summary line; `--out FILE` also writes the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_common  # noqa: E402
from gpu_common import CONFIGS, make_engine  # noqa: E402

from inference_service.engine.sampling_params import SamplingParams  # noqa: E402

CASES = ("none", "penalty")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_case(engine, case: str, batch: int, prompt_len: int, steps: int, tag: str) -> float:
    """Decode steps a second over `steps` steps of `batch` running requests (prefill excluded)."""
    vocab = engine.loaded.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        penalty = 1.3 if case == "penalty" and i == batch // 2 else 1.0
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True, repetition_penalty=penalty)
        prompt = torch.randint(0, min(vocab, 32000), (prompt_len,), generator=gen).tolist()
        engine.add_request(engine.input_processor.process(f"{tag}-{i}", prompt, params))
    # Prefill (and the first decode), untimed.
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    engine.step()
    engine.step()
    _sync(engine.device.type)
    t0 = time.perf_counter()
    for _ in range(steps - 2):
        engine.step()
    _sync(engine.device.type)
    rate = (steps - 2) / (time.perf_counter() - t0)
    while engine.has_unfinished:
        engine.step()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model folder, or a name under bench/configs (dummy weights); default: the embedded model")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=None, help="running requests (default: 16 on cpu, 256 on cuda)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per repetition")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of each case, interleaved (median kept)")
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    args = parser.parse_args()
    batch = args.batch or (16 if args.device == "cpu" else 256)
    gpu_common.DEVICE = args.device
    model, load_format = args.model, "auto"
    if model is not None and os.path.isdir(os.path.join(CONFIGS, model)):
        model, load_format = os.path.join(CONFIGS, model), "dummy"
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    kv_mib = 256 if args.device == "cpu" else None
    engine = make_engine(model, args.device, dtype, load_format=load_format, kv_mib=kv_mib,
                         max_num_seqs=max(batch, 16), max_num_batched_tokens=max(2048, batch))
    rates: dict[str, list[float]] = {case: [] for case in CASES}
    time_case(engine, "none", batch, args.prompt_len, 8, "warmup")
    for r in range(args.repeats):
        for case in CASES:
            rate = time_case(engine, case, batch, args.prompt_len, args.steps, f"{case}{r}")
            rates[case].append(rate)
            print(json.dumps({"case": case, "repeat": r, "steps_per_s": round(rate, 2)}), flush=True)
    median = {case: statistics.median(v) for case, v in rates.items()}
    summary = {
        "device": args.device, "model": args.model or "embedded", "batch": batch, "steps": args.steps,
        "async_scheduling": engine.is_async_scheduling,
        "steps_per_s": {case: round(v, 2) for case, v in median.items()},
        "penalty_over_none": round(median["penalty"] / median["none"], 4),
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
