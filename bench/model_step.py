"""Decode step time of the embedded SmolLM2's bare model (no engine, no scheduler) through the paged test
harness, per batch size: what the model itself costs a token on this machine.

    python bench/model_step.py [--batch 1 16] [--steps 40] [--isa amx avx512 --rounds 3] [--context 1000]
                               [--cache-dtypes float32 float16]

With several `--isa` or `--cache-dtypes` (the KV cache's, as `--kv-cache-dtype` sets it), the settings alternate
round by round in one process (this machine's speed drifts between minutes), and each one's median over all its
steps is reported. `--context` prefills the prompt repeated to that many tokens first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference_service.cpu_kernels.quant import load_extension  # noqa: E402
from inference_service.model.loader import load_model  # noqa: E402
from tests.model.harness import PagedHarness  # noqa: E402

# isort: split
# NOTE: after inference_service, which sets GOMP_SPINCOUNT before torch first loads libgomp (the engine's setting).
import torch  # noqa: E402

PROMPT = [{"role": "user", "content": "Tell me a long story about a dragon."}]


def step_times(harness: PagedHarness, prompt_ids: list[int], batch: int, num_steps: int) -> list[float]:
    """Sorted wall times of `num_steps` decode steps of `batch` sequences after one prefill of the prompt."""
    tables: list[list[int]] = [[] for _ in range(batch)]
    harness.step([prompt_ids] * batch, [0] * batch, tables)
    cached = [len(prompt_ids)] * batch
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        harness.step([[5]] * batch, cached, tables)
        times.append(time.perf_counter() - t0)
        cached = [c + 1 for c in cached]
    harness.free_blocks.extend(b for table in tables for b in table)
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes to time")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per batch size")
    parser.add_argument("--isa", nargs="+", default=[None], help="quantized matmul paths to alternate (amx, avx512)")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of the --isa paths and cache dtypes")
    parser.add_argument("--context", type=int, default=0, help="prompt tokens (the chat prompt repeated)")
    parser.add_argument("--cache-dtypes", nargs="+", default=["float32"], help="KV cache dtypes to alternate")
    args = parser.parse_args()
    loaded = load_model(None)
    tok = loaded.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(PROMPT), add_special_tokens=False)
    if args.context:
        prompt_ids = (prompt_ids * (args.context // len(prompt_ids) + 1))[:args.context]
    num_blocks = max(512, max(args.batch) * -(-(len(prompt_ids) + args.steps) // 16))
    harnesses = {name: PagedHarness(loaded.model, num_blocks=num_blocks, cache_dtype=getattr(torch, name))
                 for name in args.cache_dtypes}
    ext = load_extension()
    settings = [(isa, name) for isa in args.isa for name in args.cache_dtypes]
    for batch in args.batch:
        times: dict[tuple, list[float]] = {setting: [] for setting in settings}
        for _ in range(args.rounds):
            for isa, name in settings:
                if isa is not None:
                    ext.limit_instruction_set(isa)
                times[isa, name].extend(step_times(harnesses[name], prompt_ids, batch, args.steps))
        for (isa, name), isa_times in times.items():
            isa_times.sort()
            median = isa_times[len(isa_times) // 2]
            label = (f"batch {batch}" + ("" if isa is None else f" {isa}")
                     + ("" if len(args.cache_dtypes) == 1 else f" {name}"))
            print(f"{label:<16}: median step {median * 1000:.1f} ms, "
                  f"min {isa_times[0] * 1000:.1f} ms -> {batch / median:.1f} tok/s (best {batch / isa_times[0]:.1f})")
    if ext is not None:
        ext.limit_instruction_set("amx")


if __name__ == "__main__":
    main()
