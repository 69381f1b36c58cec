"""Paged prefill attention tiles on this GPU, the way a served prefill calls it (Llama-3-8B heads: 32 query heads,
8 KV heads, head_dim 128, pages of 16), for a bf16 and an fp8 KV cache, beside torch's SDPA backends on contiguous
K/V (what a prefill without a cached prefix could call instead).

    python bench/prefill_attention_tune.py [--lens 1024,4096] [--out DIR]
    python bench/prefill_attention_tune.py --only layouts   # cuDNN's SDPA on the layouts a prefill could hand it

Prints one line a (cache dtype, length, config) in TFLOP/s of causal attention FLOPs, and writes
prefill_attention_tune.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kernels import paged_prefill_attention  # noqa: E402
from kernels._common import FP8_DTYPE  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
# (block_m, block_n, num_warps, num_stages); the first is the launcher's default
CONFIGS = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4),
           (128, 128, 8, 3), (128, 32, 8, 3), (128, 64, 4, 3), (64, 32, 4, 4)]


def time_ms(call, reps: int = 20) -> float:
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            call()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def host_overheads(num_calls: int = 400) -> list[dict]:
    """Host time a call of the engine's dense prefill (SDPA under each backend order) at 128 tokens, where the
    GPU's part is a few microseconds: the wall time of a stream of calls is the host's."""
    from torch.nn.attention import SDPBackend

    from inference_service.attention import dense_prefill

    rows = []
    length = 128
    q = torch.randn(length, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v, out = torch.randn_like(k), torch.empty_like(q)
    orders = {"cudnn first": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
              "flash first": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]}
    saved = dense_prefill._BACKENDS
    for name, order in orders.items():
        dense_prefill._BACKENDS = order
        call = lambda: dense_prefill.dense_prefill_attention(q, k, v, [(0, length)], HEAD_DIM**-0.5)  # noqa: E731
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(num_calls):
            call()
        torch.cuda.synchronize()
        us = (time.perf_counter() - start) / num_calls * 1e6
        rows.append({"kind": "host us a dense call", "cfg": name, "us": round(us, 1)})
        print(f"dense prefill call, {name}: {us:.1f} us a call (128 tokens)", flush=True)
    dense_prefill._BACKENDS = saved
    return rows


def dense_layouts(length: int) -> list[dict]:
    """cuDNN's causal SDPA (the dense prefill's) at `length` tokens on the operand layouts a prefill step can hand
    it: views of the qkv projection's output [L, Hq + 2 Hkv, D] (what the engine passes), K and V copied head-major
    first, all three head-major, and separate [L, H, D] tensors; ms with and without the copies."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flops = 4 * NUM_Q_HEADS * HEAD_DIM * (length * (length + 1) // 2)
    qkv = torch.randn(length, NUM_Q_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([NUM_Q_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)  # [L, H, D] views

    def head_major(t: torch.Tensor) -> torch.Tensor:  # [L, H, D] -> [1, H, L, D] (a view)
        return t.transpose(0, 1).unsqueeze(0)

    def sdpa(qh, kh, vh):
        return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)

    copies = {name: head_major(t).contiguous() for name, t in (("q", q), ("k", k), ("v", v))}
    separate = {name: t.contiguous() for name, t in (("q", q), ("k", k), ("v", v))}
    variants = {
        "qkv views (engine)": lambda: sdpa(head_major(q), head_major(k), head_major(v)),
        "k, v head-major (copies timed)": lambda: sdpa(head_major(q), head_major(k).contiguous(),
                                                       head_major(v).contiguous()),
        "k, v head-major (no copies)": lambda: sdpa(head_major(q), copies["k"], copies["v"]),
        "all head-major (copies timed)": lambda: sdpa(head_major(q).contiguous(), head_major(k).contiguous(),
                                                      head_major(v).contiguous()),
        "all head-major (no copies)": lambda: sdpa(copies["q"], copies["k"], copies["v"]),
        "separate [L, H, D] (no copies)": lambda: sdpa(*(head_major(separate[n]) for n in "qkv")),
    }
    rows = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        for name, call in variants.items():
            with sdpa_kernel(backend):
                ms = time_ms(call)
            row = {"kind": "dense layout", "len": length, "cfg": f"{backend.name}: {name}", "ms": round(ms, 4),
                   "TFLOPs": round(flops / (ms * 1e-3) / 1e12, 1)}
            rows.append(row)
            print(f"{row['cfg']:>50} len={length}: {ms:.4f} ms {row['TFLOPs']:.0f} TFLOP/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lens", default="1024,4096")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default="paged,layouts", help="paged (tiles and SDPA), layouts (dense_layouts)")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    if "layouts" in args.only:
        for length in (int(x) for x in args.lens.split(",")):
            rows += dense_layouts(length)
    for length in (int(x) for x in args.lens.split(",") if "paged" in args.only):
        pages = length // PAGE
        q = torch.randn(length, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(pages + 1, PAGE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        block_tables = (torch.randperm(pages, device="cuda") + 1).to(torch.int32).view(1, pages)
        qsl = torch.tensor([0, length], dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor([length], dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        flops = 4 * NUM_Q_HEADS * HEAD_DIM * (length * (length + 1) // 2)

        def record(kind: str, cfg, ms: float) -> None:
            row = {"kind": kind, "len": length, "cfg": cfg, "ms": round(ms, 4),
                   "TFLOPs": round(flops / (ms * 1e-3) / 1e12, 1)}
            rows.append(row)
            print(f"{kind:>12} len={length:5d} cfg={cfg}: {ms:.3f} ms {row['TFLOPs']:.0f} TFLOP/s", flush=True)

        for kind, (kc, vc, scale) in {"paged bf16": (k, v, 1.0),
                                      "paged fp8": (k.to(FP8_DTYPE), v.to(FP8_DTYPE), 0.5)}.items():
            for bm, bn, warps, stages in CONFIGS:
                try:
                    record(kind, [bm, bn, warps, stages], time_ms(lambda: paged_prefill_attention(
                        q, kc, vc, block_tables, qsl, seq_lens, length, HEAD_DIM**-0.5, out=out, k_scale=scale,
                        v_scale=scale, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)))
                except Exception as e:  # noqa: BLE001 - a config the compiler cannot fit is skipped
                    print(f"{kind} cfg {bm},{bn},{warps},{stages} failed: {type(e).__name__}: {str(e)[:160]}")
        qd = q.view(1, length, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
        kd = torch.randn(1, NUM_KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        vd = torch.randn_like(kd)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    record("sdpa", backend.name, time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qd, kd, vd, is_causal=True, enable_gqa=True)))
            except Exception as e:  # noqa: BLE001
                print(f"sdpa {backend.name} failed: {type(e).__name__}: {str(e)[:160]}")
            try:  # GQA expanded to every query head (what a backend without enable_gqa needs)
                ke, ve = kd.repeat_interleave(NUM_Q_HEADS // NUM_KV_HEADS, 1), vd.repeat_interleave(4, 1)
                with sdpa_kernel(backend):
                    record("sdpa expand", backend.name, time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qd, ke, ve, is_causal=True)))
            except Exception as e:  # noqa: BLE001
                print(f"sdpa expanded {backend.name} failed: {type(e).__name__}: {str(e)[:160]}")
        torch.cuda.empty_cache()
    rows += host_overheads()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "prefill_attention_tune.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
