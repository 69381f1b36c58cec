"""A decode GEMV's one-row tiles judged where they run: batch-1 decode of the engine (CUDA graphs, PDL) with
the kernel's tile choice overridden, variants alternated round by round in one process (issue 18).

A projection timed alone is a poor guide to the step: on an H200 the int4 tensor-core GEMV's gate_up ran 16%
faster alone in 64-column tiles split twice, and the step with them 4% slower; the fp8 GEMV's 4 x 2048 tiles
lost to 8 x 1024 alone and won the step by 10% (bench/results/h200-2026-11-28).

    python bench/step_tiles.py --method fp8 --variants base fp8_gemv:block_n=4,block_k=2048 --rounds 2 --out F.json
    python bench/step_tiles.py --method int4 --variants base quant_gemv_tc:split_fill=3 quant_gemv_tc:block_n=64

A variant is `base` (the shipped tiles) or `KERNEL:key=value,...`, overriding what the kernel's config function
returns for one row: `fp8_gemv` (block_n, block_k, num_warps, num_stages), `quant_gemv_tc` (block_n, split_k,
num_warps, num_stages; split_fill=F re-derives split_k until the grid holds F programs a multiprocessor) and
`quant_gemv` (the CUDA-core GEMV of the formats the tensor cores do not take, e.g. GGUF Q4_K / Q8_0: block_n,
block_k, num_warps, num_stages, at every row count it serves). `KERNEL[key=value,...]:...` overrides only the calls
whose shipped tiles match the bracket, e.g. `quant_gemv_tc[block_n=128]:num_warps=8` (`quant_gemv_tc` also
matches the weight's n and k: `quant_gemv_tc[n=28672]:block_n=64` retiles gate_up alone). GPU only (Llama-3-8B dummy
weights, `--method` quantizes them in situ as `serve --quantization` does). Prints a JSON line a measurement.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpu_common  # noqa: E402
import gpu_perf  # noqa: E402
import torch  # noqa: E402
from gpu_quant_served import batch1_decode_tok_s  # noqa: E402

from kernels.quant_gemv_tc_tiles import MAX_ROWS, k_splits  # noqa: E402

# NOTE: the modules by name (`kernels` exports functions of the same names)
# kernel: (its module, the name of the config function its launcher looks up there at every call)
KERNELS = {"fp8_gemv": (importlib.import_module("kernels.fp8_gemv"), "fp8_gemv_config"),
           "quant_gemv_tc": (importlib.import_module("kernels.quant_gemv_tc"), "quant_gemv_tc_config"),
           "quant_gemv": (importlib.import_module("kernels.quant_gemv"), "quant_gemv_config")}
INT_KEYS = {"block_n", "block_k", "split_k", "num_warps", "num_stages"}


def _key_values(text: str, spec: str, keys: set) -> dict:
    """'k=v,k=v' -> {k: v}, values ints (split_fill a float)."""
    values = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key not in keys or not value:
            raise SystemExit(f"variant {text!r}: unknown or empty key {key!r}")
        values[key] = float(value) if key == "split_fill" else int(value)
    return values


def parse_variant(text: str) -> tuple[str | None, dict, dict]:
    """'base' -> (None, {}, {}); 'KERNEL[k=v,...]:k=v,...' -> (KERNEL, the tiles to set, the shipped tiles a call
    must have for them to be set)."""
    if text == "base":
        return None, {}, {}
    head, _, spec = text.partition(":")
    kernel, _, selector = head.partition("[")
    if kernel not in KERNELS or not spec or (selector and not selector.endswith("]")):
        raise SystemExit(f"variant {text!r}: base or KERNEL[key=value,...]:key=value,... with KERNEL one of "
                         f"{sorted(KERNELS)}")
    match = _key_values(text, selector[:-1], INT_KEYS | {"n", "k"}) if selector else {}
    return kernel, _key_values(text, spec, INT_KEYS | {"split_fill"}), match


def install(kernel: str | None, tiles: dict, match: dict) -> None:
    """Every kernel's config function back to the shipped one, then `kernel`'s overridden at one row where its
    shipped tiles have `match`'s values."""
    for module, attr in KERNELS.values():
        shipped = getattr(module, "_shipped_" + attr, None) or getattr(module, attr)
        setattr(module, "_shipped_" + attr, shipped)
        setattr(module, attr, shipped)
    if kernel is None:
        return
    module, attr = KERNELS[kernel]
    shipped = getattr(module, "_shipped_" + attr)

    def config(*args, **kwargs):
        cfg = dict(shipped(*args, **kwargs))
        facts = {**cfg, "n": args[0], "k": args[1]} if kernel == "quant_gemv_tc" else cfg
        if any(facts.get(key) != value for key, value in match.items()):
            return cfg
        if kernel == "quant_gemv_tc":
            n, k, device = args[0], args[1], args[3]
            num_rows = kwargs.get("num_rows", args[6] if len(args) > 6 else 1)
            if num_rows > MAX_ROWS:
                return cfg
            cfg.update({key: v for key, v in tiles.items() if key != "split_fill"})
            if "split_fill" in tiles:
                cfg["split_k"] = k_splits(n, k, num_rows, cfg["block_n"], cfg["block_m"], cfg["block_k"],
                                          tiles["split_fill"], device)
        elif kernel == "fp8_gemv":
            if args[0] != 1:  # num_rows
                return cfg
            cfg.update(tiles)
        else:
            cfg.update(tiles)
        return cfg

    setattr(module, attr, config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="int4", help="in-situ quantization (int4, int8, fp8)")
    p.add_argument("--variants", nargs="+", default=["base"], help="base or KERNEL:key=value,...")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the variants")
    p.add_argument("--out", default="", help="JSON file for the results")
    args = p.parse_args()
    variants = [(text, *parse_variant(text)) for text in args.variants]
    gpu_common.DEVICE = "cuda"
    copy_gbs = gpu_common.copy_bandwidth_gbs()
    loaded, _ = gpu_perf.load_llama(quantization=args.method)
    step_bytes = gpu_common.stored_bytes_per_step(loaded.model)
    rows = []
    for rnd in range(args.rounds):
        for text, kernel, tiles, match in variants:
            install(kernel, tiles, match)
            loaded.model.stack.can_fold_gemv = None  # re-planned (and graphs captured) by the new engine
            engine = gpu_common.make_engine(loaded.model_path, "cuda", "bfloat16", load_format="dummy",
                                            loaded=loaded, max_cuda_graph_batch_size=8)
            tok_s = batch1_decode_tok_s(engine, request_id=f"r{rnd}")
            row = {"variant": text, "round": rnd, "tok_s": round(tok_s, 1),
                   "weights_tb_s": round(tok_s * step_bytes / 1e12, 3),
                   "ratio_to_copy": round(tok_s * step_bytes / (copy_gbs * 1e9), 3)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del engine
            gc.collect()
            gpu_common.free_device_memory()
    install(None, {}, {})
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "method": args.method, "copy_gbs": round(copy_gbs, 1),
                       "step_gb": round(step_bytes / 1e9, 3), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
