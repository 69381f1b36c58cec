"""Decode step time of the embedded SmolLM2's bare model (no engine, no scheduler) through the paged test
harness, per batch size: what the model itself costs a token on this machine.

    python bench/model_step.py [--batch 1 16] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from inference_service.model.loader import load_model  # noqa: E402
from tests.model.harness import PagedHarness  # noqa: E402

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
    args = parser.parse_args()
    loaded = load_model(None)
    harness = PagedHarness(loaded.model, num_blocks=512)
    tok = loaded.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(PROMPT), add_special_tokens=False)
    for batch in args.batch:
        times = step_times(harness, prompt_ids, batch, args.steps)
        median = times[len(times) // 2]
        print(f"batch {batch}: median step {median * 1000:.1f} ms, min {times[0] * 1000:.1f} ms "
              f"-> {batch / median:.1f} tok/s (best {batch / times[0]:.1f})")


if __name__ == "__main__":
    main()
