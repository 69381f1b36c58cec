"""Host time of an engine step at hundreds of running sequences, on the CPU, by part.

The GPU engine's decode step at 384 sequences takes ~25 ms of GPU time (Llama-3-8B, H100); with async
scheduling the host's scheduling, input preparation and output processing must fit under it. This
runs the same engine on the CPU over a tiny dummy Llama (2 layers, hidden 64, Llama-3's vocabulary of
128,256 ids, the byte tokenizer as in the GPU bench), so the model costs next to nothing and what is
timed is the host's work per step, as output grows:

    python bench/host_overhead.py [--num-seqs 384] [--prompt-len 1000] [--output-len 800]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from gpu_common import HostTimer, make_engine

from inference_service.engine.sampling_params import SamplingParams

TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=384)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=800)
    parser.add_argument("--window", type=int, default=100, help="steps averaged per report")
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**TINY_LLAMA, "max_position_embeddings": args.prompt_len + args.output_len + 16}, f)
    engine = make_engine(folder, "cpu", "float32", load_format="dummy", kv_mib=4096, max_num_seqs=args.num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_seqs):
        prompt = torch.randint(0, 128000, (args.prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
        engine.add_request(engine.input_processor.process(f"r{i}", prompt, params))
    timer = HostTimer()
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)
    engine.model_runner.inputs.prepare = timer.wrap("prepare", engine.model_runner.inputs.prepare)
    engine.update_from_output = timer.wrap("update_from_output", engine.update_from_output)
    steps = 0
    print(f"{args.num_seqs} sequences, {args.prompt_len}-token prompts: host ms a step (mean of {args.window})")
    print(f"{'after step':>10} {'schedule':>9} {'prepare':>8} {'update_from_output':>19} {'total':>7}")
    while engine.has_unfinished:
        if steps % args.window == 0:
            timer.totals.clear()
        engine.step()
        steps += 1
        if steps % args.window == 0 and len(engine.scheduler.running) == args.num_seqs:
            row = {k: v / args.window * 1e3 for k, v in timer.totals.items()}
            print(f"{steps:>10} {row['schedule']:>9.2f} {row['prepare']:>8.2f} {row['update_from_output']:>19.2f} "
                  f"{sum(row.values()):>7.2f}", flush=True)


if __name__ == "__main__":
    main()
