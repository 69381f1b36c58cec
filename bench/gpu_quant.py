"""Quantized weights on the GPU: the decode weight pass per format against its roofline (issue 18).

Sections (results in `--out`/gpu_quant.json and gpu_quant.md; each runs even if an earlier one failed):
  ceilings   device-to-device copy bandwidth (bytes read + written): the roofline of every row.
  pass_b1    batch 1, Llama-3-8B shapes, all 32 layers' projections (qkv, o, gate_up, down) in each format
             plus a bf16 lm_head, chained in one CUDA graph, replayed: the weights-only part of a decode
             step. tok/s = 1 / pass time; roofline = copy GB/s / bytes the pass reads.
  pass_b16   the same at batch 16 (the decode GEMV's last row count).
  pass_b64   batch 64 (4-bit codes in groups of 128 or more: the tensor-core GEMV in row blocks, `row_blocks_win`).
  pass_b256  batch 256 (the GEMM path): int4 and the others against bf16 (target: int4 no slower).
  memory     GPU memory of the int4 model's weights (packed projections + bf16 embeddings and lm_head).
  crossover  1-16 rows: the decode kernels (quant_gemv, fp8_gemv) against the tensor-core paths
             (quant_gemm, fp8 x fp8), all layers' projections of int4 / Q4_K / fp8: where to switch.
  sweep      batch-1 GEMV tiles for int4 and Q4_K over the four projection shapes (`--sweep`).
  twins      tiny GPTQ/AWQ/compressed-tensors/fp8 Llamas served vs their dequantized twins (fp32, bf16):
             first greedy divergence per prompt.
  served     the engine's own decode (128-token prompt, 512 new tokens, CUDA graphs, batch 1): bf16 and
             each `--quantization` (int4, int8, fp8) quantized in situ from the same random weights.

Formats: bf16 (the `gemv` kernel at 1-4 rows, cuBLAS past), int4 g128 as GPTQ (constant zero) and AWQ
(a zeros plane), GGUF Q4_K / Q8_0 layouts, fp8 per channel and fp8 [128, 128] blocks. The weights are
random codes in each layout (the kernels read the same bytes as for a real checkpoint).

Usage: python bench/gpu_quant.py --out DIR [--only a,b] [--sweep]          (on the GPU, < 10 minutes)
       python bench/gpu_quant.py --out DIR --smoke                          (CPU, interpreter, tiny shapes)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_quant.json and gpu_quant.md")
    p.add_argument("--config", default=os.path.join(ROOT, "bench", "configs", "llama-3-8b", "config.json"))
    p.add_argument("--only", default="", help="comma-separated sections")
    p.add_argument("--sweep", action="store_true", help="also sweep the GEMV tiles")
    p.add_argument("--sweep-formats", default="int4_gptq_g128,int4_gptq_g128+fused,q4_k,q8_0",
                   help="formats the sweep runs (int and fp8 layouts); FMT+fused: with the fused decoder's options")
    p.add_argument("--sweep-block-k", default="128,256,512,1024", help="K tiles the sweep tries")
    p.add_argument("--formats", default="",
                   help="formats the pass and crossover sections run (comma-separated; default all / three)")
    p.add_argument("--served-methods", default="bf16,int4,int8,fp8", help="weights the served section decodes with")
    p.add_argument("--smoke", action="store_true", help="CPU dry run: Triton interpreter, a tiny model")
    p.add_argument("--row-major", action="store_true", help="pass sections: 4-bit codes row-major, not in row tiles")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:  # NOTE: before `kernels` (triton.jit) is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import gpu_common
from gpu_common import graph_seconds
from gpu_quant_report import markdown
from gpu_quant_served import section_served
from gpu_quant_twins import section_twins

from kernels import gemv
from kernels.fp8_gemm import Fp8Weight, fp8_linear, fp8_quantized_matmul
from kernels.fp8_gemv import fp8_gemv
from kernels.quant_gemm import quant_gemm, quant_matmul
from kernels.quant_gemv import quant_gemv
from kernels.quant_layout import IntPackedWeight
from kernels.quant_tiles import with_row_tiles

DEVICE = torch.device("cpu" if ARGS.smoke else "cuda")
BF16 = torch.bfloat16
SMOKE_SHAPES = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
                "num_hidden_layers": 1, "vocab_size": 256}
# format: (bits, group (None: per channel), scale dtype, zeros plane, offsets); GGUF's K-quants as the loader
# repacks them (fp32 products per group; Q5_K / Q6_K codes one a byte)
INT_LAYOUTS = {"int4_gptq_g128": (4, 128, torch.float16, False, False),
               "int4_awq_g128": (4, 128, torch.float16, True, False),
               "q4_k": (4, 32, torch.float32, False, True),
               "q5_k": (8, 32, torch.float32, False, True),
               "q6_k": (8, 16, torch.float32, False, False),
               "q4_0": (4, 32, torch.float16, False, False),
               "q8_0": (8, 32, torch.float16, False, False)}
FP8_LAYOUTS = {"fp8_channel": None, "fp8_block128": (128, 128)}
FORMATS = ["bf16", *INT_LAYOUTS, *FP8_LAYOUTS]
TARGETS_B1 = {"int4_gptq_g128": 400, "int4_awq_g128": 400, "q4_k": 380, "q8_0": 280, "fp8_channel": 300,
              "fp8_block128": 300}


# ------------------------------------------------------------------------------------------ weights

def model_shapes() -> dict:
    with open(ARGS.config, encoding="utf-8") as f:
        cfg = json.load(f)
    if ARGS.smoke:
        cfg.update(SMOKE_SHAPES)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"projections": [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * i, h), ("down", h, i)],
            "num_layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"], "hidden": h}


def random_weight(fmt: str, n: int, k: int):
    """An [n, k] weight in `fmt` with random contents, on DEVICE."""
    if fmt == "bf16":
        return torch.randn(n, k, device=DEVICE, dtype=BF16) * 0.02
    if fmt in INT_LAYOUTS:
        bits, group, scale_dtype, has_zeros, has_offsets = INT_LAYOUTS[fmt]
        group = group or k
        groups = (n, k // group)
        qs = torch.randint(0, 256, (n, k if bits == 8 else k // 2), dtype=torch.uint8, device=DEVICE)
        zeros = torch.randint(0, 16, groups, dtype=torch.uint8, device=DEVICE) if has_zeros else None
        scales = (torch.rand(groups, device=DEVICE) * 0.002).to(scale_dtype)
        offsets = (torch.rand(groups, device=DEVICE) * -0.01).to(scale_dtype) if has_offsets else None
        w = IntPackedWeight(bits, group, qs, scales, zeros=zeros, zero=1 << (bits - 1), offsets=offsets)
        return w if ARGS.row_major else with_row_tiles(w)  # the layout the engine loads
    block_n, block_k = FP8_LAYOUTS[fmt] or (1, k)
    q = (torch.randn(n, k, device=DEVICE) * 64).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block_n), -(-k // block_k), device=DEVICE) * 1e-3
    return Fp8Weight(q, scale, block_n, block_k)


def nbytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def matmul(x: torch.Tensor, w) -> torch.Tensor:
    """What the served path would run for this weight and row count."""
    if isinstance(w, torch.Tensor):
        return gemv(x, w) if x.shape[0] <= 4 else x @ w.T
    if isinstance(w, IntPackedWeight):
        return quant_matmul(x, w)
    return fp8_linear(x, w)


# ------------------------------------------------------------------------------------------ timing

def time_call(fn, reps: int = 20) -> float:
    """Median seconds of fn(): CUDA-graph replays on the GPU, plain calls on the CPU."""
    if DEVICE.type == "cpu":
        t0 = time.perf_counter()  # the interpreter: one call (the numbers only show the script runs)
        fn()
        return time.perf_counter() - t0
    return graph_seconds(fn, reps)


def copy_bandwidth_gbs() -> float:
    """The copy rate the rooflines divide by, as the other benches measure it: plain copies. Not a graph replay:
    a captured device-to-device copy is a memcpy node on a copy engine, which moved 2,755 GB/s on an H200 whose
    copy kernel moves 4,163-4,230 (bench/results/h200-2026-11-28), so every ratio before 2026-11-28 is high."""
    gpu_common.DEVICE = DEVICE.type
    return gpu_common.copy_bandwidth_gbs((1 << 20) if ARGS.smoke else (1 << 30))


# ------------------------------------------------------------------------------------------ sections

def weight_pass(fmt: str, shapes: dict, num_rows: int, results: dict, copy_gbs: float) -> dict:
    """All layers' projections in `fmt` + a bf16 lm_head, one chain of matmuls at `num_rows` rows."""
    layers = [[random_weight(fmt, n, k) for _, n, k in shapes["projections"]] for _ in range(shapes["num_layers"])]
    lm_head = random_weight("bf16", shapes["vocab"], shapes["hidden"])
    inputs = {k: torch.randn(num_rows, k, device=DEVICE, dtype=BF16) for _, _, k in shapes["projections"]}
    ks = [k for _, _, k in shapes["projections"]]

    def run():
        for layer in layers:
            for w, k in zip(layer, ks):
                matmul(inputs[k], w)
        matmul(inputs[shapes["hidden"]], lm_head)

    seconds = time_call(run)
    num_bytes = sum(nbytes(w) for layer in layers for w in layer) + nbytes(lm_head)
    roofline = copy_gbs * 1e9 / num_bytes
    row = {"format": fmt, "batch": num_rows, "pass_ms": round(seconds * 1e3, 3), "gb_per_step": round(num_bytes / 1e9, 3),
           "gbs": round(num_bytes / seconds / 1e9, 1), "tok_s_per_seq": round(1 / seconds, 1),
           "tok_s_total": round(num_rows / seconds, 1),
           "roofline_tok_s": round(roofline, 1), "ratio_to_roofline": round(1 / seconds / roofline, 3)}
    return row


def free_memory() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def section_pass(shapes: dict, results: dict, key: str, num_rows: int) -> None:
    copy_gbs = results["ceilings"]["copy_gbs"]
    rows = []
    for fmt in [f for f in FORMATS if not ARGS.formats or f in ARGS.formats.split(",")]:
        try:
            rows.append(weight_pass(fmt, shapes, num_rows, results, copy_gbs))
        except Exception as exc:  # noqa: BLE001 - one format failing must not hide the others
            rows.append({"format": fmt, "batch": num_rows, "error": f"{type(exc).__name__}: {exc}"})
        free_memory()  # the format's weights went with weight_pass's frame
        print(rows[-1], flush=True)
    bf16 = next((r for r in rows if r["format"] == "bf16" and "pass_ms" in r), None)
    for r in rows:
        if bf16 and "pass_ms" in r:
            r["speed_vs_bf16"] = round(bf16["pass_ms"] / r["pass_ms"], 3)
        if num_rows == 1 and r["format"] in TARGETS_B1:
            r["target_tok_s"] = TARGETS_B1[r["format"]]
    results[key] = rows


def section_memory(shapes: dict, results: dict) -> None:
    """int4 g128 projections (GPTQ layout) + bf16 embeddings and lm_head, as loaded; target <= 5.7 GB."""
    before = 0
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
    layers = [[random_weight("int4_gptq_g128", n, k) for _, n, k in shapes["projections"]]
              for _ in range(shapes["num_layers"])]
    embed = [random_weight("bf16", shapes["vocab"], shapes["hidden"]) for _ in range(2)]  # embed_tokens, lm_head
    counted = sum(nbytes(w) for layer in layers for w in layer) + sum(nbytes(w) for w in embed)
    counted += shapes["num_layers"] * 2 * shapes["hidden"] * 2 + shapes["hidden"] * 2  # RMSNorm weights, bf16
    allocated = (torch.cuda.memory_allocated() - before) if DEVICE.type == "cuda" else counted
    results["memory"] = {"format": "int4_gptq_g128", "weights_gb": round(counted / 1e9, 3),
                         "allocated_gb": round(allocated / 1e9, 3), "target_gb": 5.7}
    print(results["memory"], flush=True)


# The options the fused decoder stack gives each projection (fused_stack._layer), for the "+fused" sweep.
FUSED_OPTIONS = {"qkv": ("norm",), "o": ("residual",), "gate_up": ("norm",), "down": ("gated", "residual")}


def fused_inputs(name: str, n: int, k: int) -> tuple[torch.Tensor, dict]:
    """x and the keyword options of `quant_gemv` as the fused stack calls it for projection `name`."""
    options = FUSED_OPTIONS[name]
    x = torch.randn(1, 2 * k if "gated" in options else k, device=DEVICE, dtype=BF16)
    kwargs = {}
    if "norm" in options:
        kwargs["norm_weight"] = torch.rand(k, device=DEVICE, dtype=BF16)
    if "gated" in options:
        kwargs["gated"] = True
    if "residual" in options:
        kwargs["residual"] = torch.randn(1, n, device=DEVICE, dtype=BF16)
    return x, kwargs


def section_sweep(shapes: dict, results: dict) -> None:
    """Batch-1 GEMV tiles per projection shape, GB/s (weights rotated over > L2 so each call reads memory).
    A format named FMT+fused sweeps FMT with the options the fused decoder gives each projection."""
    rows = []
    block_ks = [int(bk) for bk in ARGS.sweep_block_k.split(",")]
    tiles = [(bn, bk, nw) for bn in (4, 8, 16, 32) for bk in block_ks for nw in (4, 8)]
    formats = ARGS.sweep_formats.split(",")
    if ARGS.smoke:
        tiles, formats = tiles[:1], formats[:1]
    for fmt in formats:
        base, _, fused = fmt.partition("+")
        for name, n, k in shapes["projections"]:
            copies = 1 if ARGS.smoke else max(2, (256 << 20) // (n * k // 2))
            ws = [random_weight(base, n, k) for _ in range(copies)]
            x, kwargs = fused_inputs(name, n, k) if fused else (torch.randn(1, k, device=DEVICE, dtype=BF16), {})
            best, default = None, None
            for tile in [None, *tiles]:  # None: the kernel's own choice (quant_gemv_config)
                bn, bk, nw = tile or (None, None, None)
                try:
                    seconds = time_call(gemv_calls(x, ws, bn, bk, nw, **kwargs))
                except Exception as exc:  # noqa: BLE001 - a tile past the register budget
                    print(f"{fmt} {name} tile {tile}: {type(exc).__name__}", flush=True)
                    continue
                gbs = round(sum(nbytes(w) for w in ws) / seconds / 1e9, 1)
                if tile is None:
                    default = gbs
                elif best is None or gbs > best["gbs"]:
                    best = {"format": fmt, "projection": name, "n": n, "k": k, "block_n": bn, "block_k": bk,
                            "num_warps": nw, "gbs": gbs}
            if best is not None:
                best["default_gbs"] = default
            rows.append(best)
            print(best, flush=True)
            ws.clear()
            free_memory()
    results["sweep"] = rows


def section_crossover(shapes: dict, results: dict) -> None:
    """The decode kernels against the tensor-core paths at 1-16 rows (all layers' projections of one
    format, one CUDA graph): where `quant_matmul` and `fp8_linear` should switch from one to the other."""
    rows_out = []
    row_counts = (1, 2, 3, 4, 8, 16) if not ARGS.smoke else (1, 2)
    for fmt in ARGS.formats.split(",") if ARGS.formats else ("int4_gptq_g128", "q4_k", "fp8_channel"):
        layers = [random_weight(fmt, n, k) for _, n, k in shapes["projections"] for _ in range(shapes["num_layers"])]
        is_fp8 = fmt.startswith("fp8")
        decode = (lambda x, w: fp8_gemv(x, w.weight, w.scale, w.block_n, w.block_k)) if is_fp8 else quant_gemv
        tensor_cores = fp8_quantized_matmul if is_fp8 else quant_gemm
        for num_rows in row_counts:
            inputs = {k: torch.randn(num_rows, k, device=DEVICE, dtype=BF16) for _, _, k in shapes["projections"]}
            row = {"format": fmt, "rows": num_rows}
            for name, fn in (("decode_ms", decode), ("tensor_core_ms", tensor_cores)):
                try:
                    row[name] = round(time_call(lambda fn=fn: [fn(inputs[w.shape[1]], w) for w in layers]) * 1e3, 3)
                except Exception as exc:  # noqa: BLE001 - one path failing must not hide the other
                    row[name] = f"{type(exc).__name__}: {exc}"[:200]
            rows_out.append(row)
            print(row, flush=True)
        layers.clear()
        free_memory()
    results["crossover"] = rows_out


def gemv_calls(x: torch.Tensor, ws: list, block_n: int | None, block_k: int | None, num_warps: int | None, **options):
    """The decode GEMV of ws's format (`quant_gemv` or `fp8_gemv`) over each weight, at this tile."""
    if isinstance(ws[0], Fp8Weight):
        return lambda: [fp8_gemv(x, w.weight, w.scale, w.block_n, w.block_k, tile_n=block_n, tile_k=block_k,
                                 num_warps=num_warps, **options) for w in ws]
    return lambda: [quant_gemv(x, w, block_n=block_n, block_k=block_k, num_warps=num_warps, **options) for w in ws]


# ------------------------------------------------------------------------------------------ report

def environment() -> dict:
    import triton

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    return {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (Triton interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
            "date": datetime.date.today().isoformat(), "smoke": ARGS.smoke}


def main() -> None:
    os.makedirs(ARGS.out, exist_ok=True)
    only = set(filter(None, ARGS.only.split(",")))
    shapes = model_shapes()
    results: dict = {"env": environment(), "shapes": shapes, "errors": []}
    sections = [("ceilings", lambda: results.__setitem__("ceilings", {"copy_gbs": round(copy_bandwidth_gbs(), 1)})),
                ("pass_b1", lambda: section_pass(shapes, results, "pass_b1", 1)),
                ("pass_b16", lambda: section_pass(shapes, results, "pass_b16", 16)),
                ("pass_b64", lambda: section_pass(shapes, results, "pass_b64", 64 if not ARGS.smoke else 18)),
                ("pass_b256", lambda: section_pass(shapes, results, "pass_b256", 256 if not ARGS.smoke else 20)),
                ("memory", lambda: section_memory(shapes, results)),
                ("crossover", lambda: section_crossover(shapes, results)),
                ("sweep", lambda: section_sweep(shapes, results) if ARGS.sweep else None),
                ("twins", lambda: section_twins(results, DEVICE.type) if not ARGS.smoke else None),
                ("served", lambda: (section_served(results, DEVICE.type, ARGS.served_methods.split(","))
                                    if not ARGS.smoke else None))]
    for name, run in sections:
        if only and name not in only and name != "ceilings":
            continue
        t0 = time.perf_counter()
        try:
            run()
        except Exception:  # noqa: BLE001 - report and go on with the next section
            results["errors"].append(f"{name}: {traceback.format_exc()}")
            print(results["errors"][-1], flush=True)
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", flush=True)
    with open(os.path.join(ARGS.out, "gpu_quant.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(ARGS.out, "gpu_quant.md"), "w", encoding="utf-8") as f:
        f.write(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
