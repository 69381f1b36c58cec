"""Kernel benchmarks on a CUDA device, against ceilings measured in the same run.

    ceilings:  device-to-device copy bandwidth (bytes read + written), bf16 8192^3 matmul rate
    decode:    paged decode attention, bf16, head_dim 128, 32 q heads / 8 kv heads (GQA 4), block 16,
               batch 1/16/64 x context 1k/4k/16k: bytes of K/V/Q read + output written over time
    prefill:   paged causal prefill at 4k tokens: TFLOP/s (causal FLOPs) vs the matmul rate
    small:     KV write, fused add + RMSNorm, rotary, SiLU-and-mul: achieved bandwidth

Each timed region is a CUDA graph of several calls that read different memory (so neither launch
gaps nor the L2 cache flatter the numbers), timed by triton.testing.do_bench (median).

usage: python bench/kernels_bench.py [--out DIR] [--quick]      (on a CUDA device)
       TRITON_INTERPRET=1 python bench/kernels_bench.py --smoke  (CPU: runs every path on tiny shapes)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from kernels_report import markdown  # noqa: E402
from inference_service.model.rope import build_cos_sin_cache  # noqa: E402
from kernels import (  # noqa: E402
    FP8_DTYPE,
    apply_rotary,
    choose_num_kv_splits,
    fused_add_rms_norm,
    paged_decode_attention,
    paged_prefill_attention,
    silu_and_mul,
    write_kv_cache,
)

BF16 = torch.bfloat16
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
MiB = 1 << 20

# (block_n, num_warps, num_stages); the first is the launcher's default
DECODE_CONFIGS = [(64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 4, 2), (128, 8, 3)]
# (block_m, block_n, num_warps, num_stages); the first is the launcher's default
PREFILL_CONFIGS = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (64, 64, 8, 3), (128, 64, 8, 3), (128, 32, 4, 3)]


class Bench:
    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")

    def time_calls(self, calls: list) -> float:
        """Median milliseconds per call: all `calls` captured in one CUDA graph, replayed."""
        if self.smoke:
            t = time.perf_counter()
            for c in calls:
                c()
            return (time.perf_counter() - t) * 1e3 / len(calls)
        for c in calls[:2]:
            c()  # compile, and let the allocator settle before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        ms = triton.testing.do_bench(graph.replay, warmup=25, rep=150, return_mode="median")
        del graph
        return ms / len(calls)

    def randn(self, *shape, dtype=BF16) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device).normal_()

    def free(self):
        if not self.smoke:
            torch.cuda.empty_cache()


def rotations(set_bytes: int, smoke: bool) -> int:
    """How many disjoint input sets to cycle through so consecutive calls miss the L2 cache."""
    return 2 if smoke else min(64, max(2, math.ceil(512 * MiB / set_bytes)))


# --- ceilings -------------------------------------------------------------------------------------


def bench_ceilings(b: Bench) -> dict:
    n = (1 << 30) // 2 if not b.smoke else 1 << 16  # 1 GiB of bf16
    src, dst = b.randn(n), torch.empty(n, dtype=BF16, device=b.device)
    copy_ms = b.time_calls([lambda: dst.copy_(src)]) if b.smoke else triton.testing.do_bench(
        lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")  # fmt: skip
    copy_gbs = 2 * n * 2 / (copy_ms * 1e-3) / 1e9
    del src, dst
    m = 8192 if not b.smoke else 64
    x, y = b.randn(m, m), b.randn(m, m)
    z = torch.empty(m, m, dtype=BF16, device=b.device)
    mm_ms = b.time_calls([lambda: torch.matmul(x, y, out=z)]) if b.smoke else triton.testing.do_bench(
        lambda: torch.matmul(x, y, out=z), warmup=25, rep=200, return_mode="median")  # fmt: skip
    mm_tflops = 2 * m**3 / (mm_ms * 1e-3) / 1e12
    del x, y, z
    b.free()
    return {"copy_GBps": copy_gbs, "copy_ms": copy_ms, "matmul_bf16_TFLOPs": mm_tflops, "matmul_ms": mm_ms}


# --- decode ---------------------------------------------------------------------------------------


class DecodeSetup:
    def __init__(self, b: Bench, batch: int, ctx: int, head_dim: int = HEAD_DIM):
        self.batch, self.ctx, self.head_dim = batch, ctx, head_dim
        pages = -(-ctx // PAGE)
        self.kv_bytes = batch * ctx * NUM_KV_HEADS * head_dim * 2 * 2
        self.io_bytes = self.kv_bytes + 2 * batch * NUM_Q_HEADS * head_dim * 2  # + q read, out written
        self.num_sets = rotations(self.kv_bytes, b.smoke)
        num_blocks = self.num_sets * batch * pages + 1
        self.k_cache = b.randn(num_blocks, PAGE, NUM_KV_HEADS, head_dim)
        self.v_cache = b.randn(num_blocks, PAGE, NUM_KV_HEADS, head_dim)
        perm = (torch.randperm(num_blocks - 1) + 1).to(torch.int32)  # scattered pages, as in a live cache
        self.block_tables = perm.view(self.num_sets, batch, pages).to(b.device)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=b.device)
        self.q = b.randn(batch, NUM_Q_HEADS, head_dim)
        self.out = torch.empty_like(self.q)

    def calls(self, splits, cfg):
        block_n, warps, stages = cfg
        return [
            (lambda r=r: paged_decode_attention(
                self.q, self.k_cache, self.v_cache, self.block_tables[r], self.seq_lens, self.head_dim**-0.5,
                out=self.out, num_kv_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages))
            for r in range(self.num_sets)
        ]  # fmt: skip


def bench_decode(b: Bench, ceil: dict, quick: bool) -> list[dict]:
    rows = []
    shapes = [(1, 64), (2, 128)] if b.smoke else [(bt, c) for bt in (1, 16, 64) for c in (1024, 4096, 16384)]
    configs = DECODE_CONFIGS[:2] if (b.smoke or quick) else DECODE_CONFIGS
    for batch, ctx in shapes:
        s = DecodeSetup(b, batch, ctx)
        auto = choose_num_kv_splits(batch, NUM_KV_HEADS, ctx, b.device)
        split_choices = sorted({auto} | ({max(1, auto // 2), min(64, auto * 2), max(1, auto // 4), min(64, auto * 4)}
                                         if not quick else set()))  # fmt: skip
        results = []
        for cfg in configs:
            for splits in split_choices if cfg == configs[0] else [auto]:
                try:
                    ms = b.time_calls(s.calls(splits, cfg))
                except Exception as e:  # a config the compiler cannot fit is skipped
                    print(f"decode cfg {cfg} splits {splits} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                gbs = s.io_bytes / (ms * 1e-3) / 1e9
                results.append({"block_n": cfg[0], "num_warps": cfg[1], "num_stages": cfg[2], "splits": splits,
                                "us": ms * 1e3, "GBps": gbs, "frac_of_copy": gbs / ceil["copy_GBps"]})  # fmt: skip
        default = next(r for r in results if (r["block_n"], r["num_warps"], r["num_stages"]) == configs[0]
                       and r["splits"] == auto)  # fmt: skip
        best = max(results, key=lambda r: r["GBps"])
        target = 0.7 if (batch >= 16 and ctx >= 4096) else (0.5 if (batch == 1 and ctx >= 16384) else None)
        row = {"batch": batch, "ctx": ctx, "bytes": s.io_bytes, "auto_splits": auto, "default": default,
               "best": best, "target_frac": target, "all": results}  # fmt: skip
        rows.append(row)
        print(f"decode b={batch:<3} ctx={ctx:<6} splits={auto:<3} default {default['us']:8.1f} us "
              f"{default['GBps']:7.0f} GB/s ({default['frac_of_copy']:.0%}) | best {best['GBps']:7.0f} GB/s "
              f"({best['frac_of_copy']:.0%}) cfg={best['block_n']},{best['num_warps']},{best['num_stages']} "
              f"splits={best['splits']}", flush=True)  # fmt: skip
        del s
        b.free()
    return rows


def bench_decode_fp8(b: Bench, ceil: dict) -> list[dict]:
    """fp8 KV: half the K/V bytes; reported as time and effective bandwidth of the bytes moved."""
    rows = []
    for batch, ctx in ([(2, 128)] if b.smoke else [(16, 4096), (64, 4096), (1, 16384)]):
        s = DecodeSetup(b, batch, ctx)
        s.k_cache, s.v_cache = s.k_cache.to(FP8_DTYPE), s.v_cache.to(FP8_DTYPE)
        auto = choose_num_kv_splits(batch, NUM_KV_HEADS, ctx, b.device)
        moved = s.kv_bytes // 2 + (s.io_bytes - s.kv_bytes)
        sweep = []
        for cfg in [None] + ([] if b.smoke else [(64, 4, 2), (64, 4, 1), (128, 4, 2), (128, 8, 2), (32, 4, 3)]):
            bn, w, st = cfg or (None, None, None)
            calls = [
                (lambda r=r: paged_decode_attention(s.q, s.k_cache, s.v_cache, s.block_tables[r], s.seq_lens, 0.088,
                                                    out=s.out, k_scale=0.5, v_scale=0.5, num_kv_splits=auto,
                                                    block_n=bn, num_warps=w, num_stages=st))
                for r in range(s.num_sets)
            ]  # fmt: skip
            try:
                ms = b.time_calls(calls)
            except Exception as e:
                print(f"fp8 decode cfg {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            sweep.append({"cfg": cfg or "default", "us": ms * 1e3, "GBps": moved / (ms * 1e-3) / 1e9})
        d = sweep[0]
        best = max(sweep, key=lambda r: r["GBps"])
        rows.append({"batch": batch, "ctx": ctx, "us": d["us"], "GBps": d["GBps"],
                     "frac_of_copy": d["GBps"] / ceil["copy_GBps"], "best": best, "all": sweep})  # fmt: skip
        print(f"decode fp8 KV b={batch:<3} ctx={ctx:<6} {d['us']:8.1f} us {d['GBps']:7.0f} GB/s "
              f"({d['GBps'] / ceil['copy_GBps']:.0%}) | best {best['GBps']:7.0f} GB/s cfg={best['cfg']}",
              flush=True)  # fmt: skip
        del s
        b.free()
    return rows


# --- prefill --------------------------------------------------------------------------------------


def bench_prefill(b: Bench, ceil: dict, quick: bool) -> list[dict]:
    rows = []
    shapes = [(1, 64)] if b.smoke else [(1, 4096), (4, 4096)]
    configs = PREFILL_CONFIGS[:2] if (b.smoke or quick) else PREFILL_CONFIGS
    for batch, length in shapes:
        pages = length // PAGE
        num_blocks = batch * pages + 1
        k_cache = b.randn(num_blocks, PAGE, NUM_KV_HEADS, HEAD_DIM)
        v_cache = b.randn(num_blocks, PAGE, NUM_KV_HEADS, HEAD_DIM)
        block_tables = ((torch.randperm(num_blocks - 1) + 1).to(torch.int32).view(batch, pages)).to(b.device)
        q = b.randn(batch * length, NUM_Q_HEADS, HEAD_DIM)
        out = torch.empty_like(q)
        qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=b.device) * length
        seq_lens = torch.full((batch,), length, dtype=torch.int32, device=b.device)
        flops = 4 * batch * NUM_Q_HEADS * HEAD_DIM * (length * (length + 1) // 2)
        results = []
        for bm, bn, warps, stages in configs:
            call = lambda bm=bm, bn=bn, w=warps, st=stages: paged_prefill_attention(  # noqa: E731
                q, k_cache, v_cache, block_tables, qsl, seq_lens, length, HEAD_DIM**-0.5, out=out,
                block_m=bm, block_n=bn, num_warps=w, num_stages=st)  # fmt: skip
            try:
                ms = b.time_calls([call])
            except Exception as e:  # a config the compiler cannot fit (shared memory) is skipped
                print(f"prefill cfg {bm},{bn},{warps},{stages} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            tf = flops / (ms * 1e-3) / 1e12
            results.append({"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages, "ms": ms,
                            "TFLOPs": tf, "frac_of_matmul": tf / ceil["matmul_bf16_TFLOPs"]})  # fmt: skip
        # torch's SDPA (flash) on the same shapes, contiguous K/V: a reference point, not a ceiling
        sdpa = None
        if not b.smoke:
            qd = q.view(batch, length, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
            kd = b.randn(batch, NUM_KV_HEADS, length, HEAD_DIM)
            vd = b.randn(batch, NUM_KV_HEADS, length, HEAD_DIM)
            try:
                ms = b.time_calls([lambda: torch.nn.functional.scaled_dot_product_attention(
                    qd, kd, vd, is_causal=True, enable_gqa=True)])  # fmt: skip
                sdpa = {"ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12}
            except Exception as e:
                print(f"sdpa failed: {e}")
            del qd, kd, vd
        # the same with an fp8 cache (launcher defaults)
        k8, v8 = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
        ms = b.time_calls([lambda: paged_prefill_attention(q, k8, v8, block_tables, qsl, seq_lens, length,
                                                           HEAD_DIM**-0.5, out=out, k_scale=0.5, v_scale=0.5)])
        fp8 = {"ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12}
        del k8, v8
        default, best = results[0], max(results, key=lambda r: r["TFLOPs"])
        rows.append({"batch": batch, "len": length, "flops": flops, "default": default, "best": best, "sdpa": sdpa,
                     "fp8": fp8, "all": results})  # fmt: skip
        print(f"prefill b={batch} len={length}: default {default['ms']:.3f} ms {default['TFLOPs']:.0f} TFLOP/s "
              f"({default['frac_of_matmul']:.0%} of matmul) | best {best['TFLOPs']:.0f} "
              f"cfg={best['block_m']},{best['block_n']},{best['num_warps']},{best['num_stages']} | torch sdpa "
              f"{sdpa['TFLOPs'] if sdpa else float('nan'):.0f} | fp8 KV {fp8['TFLOPs']:.0f}", flush=True)  # fmt: skip
        del k_cache, v_cache, q, out
        b.free()
    return rows


# --- small kernels --------------------------------------------------------------------------------


def bench_small(b: Bench, ceil: dict) -> list[dict]:
    rows = []
    tokens = 64 if b.smoke else 8192
    hidden, inter = (256, 512) if b.smoke else (4096, 14336)

    def record(name, bytes_, calls):
        ms = b.time_calls(calls)
        gbs = bytes_ / (ms * 1e-3) / 1e9
        rows.append({"kernel": name, "us": ms * 1e3, "GBps": gbs, "frac_of_copy": gbs / ceil["copy_GBps"]})
        print(f"{name:<40} {ms * 1e3:9.1f} us {gbs:7.0f} GB/s ({gbs / ceil['copy_GBps']:.0%})", flush=True)

    sets = 4
    # KV write: read k, v; write them into scattered cache slots
    k = [b.randn(tokens, NUM_KV_HEADS, HEAD_DIM) for _ in range(sets)]
    v = [b.randn(tokens, NUM_KV_HEADS, HEAD_DIM) for _ in range(sets)]
    num_blocks = sets * tokens // PAGE + 1
    for cache_dtype, name in ((BF16, "write_kv_cache bf16"), (FP8_DTYPE, "write_kv_cache fp8")):
        kc = torch.empty(num_blocks, PAGE, NUM_KV_HEADS, HEAD_DIM, dtype=cache_dtype, device=b.device)
        vc = torch.empty_like(kc)
        slots = torch.randperm((num_blocks - 1) * PAGE, device=b.device)[: sets * tokens].view(sets, tokens) + PAGE
        width = 1 if cache_dtype == FP8_DTYPE else 2
        bytes_ = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * (2 + width) + tokens * 8
        record(f"{name} T={tokens}", bytes_,
               [lambda i=i: write_kv_cache(k[i], v[i], kc, vc, slots[i], k_scale=0.5, v_scale=0.5)
                for i in range(sets)])  # fmt: skip
        del kc, vc
    del k, v
    # fused add + RMSNorm: read x, residual; write residual, out
    x = [b.randn(tokens, hidden) for _ in range(sets)]
    r = [b.randn(tokens, hidden) for _ in range(sets)]
    w = b.randn(hidden)
    record(f"fused_add_rms_norm T={tokens} H={hidden}", 4 * tokens * hidden * 2,
           [lambda i=i: fused_add_rms_norm(x[i], r[i], w, 1e-6) for i in range(sets)])  # fmt: skip
    del x, r
    # rotary on q and k, in place
    cache = build_cos_sin_cache(HEAD_DIM, 32768, 500000.0, device=b.device)
    q = [b.randn(tokens, NUM_Q_HEADS, HEAD_DIM) for _ in range(sets)]
    kk = [b.randn(tokens, NUM_KV_HEADS, HEAD_DIM) for _ in range(sets)]
    pos = torch.randint(0, 32768, (tokens,), device=b.device)
    record(f"apply_rotary neox T={tokens}", 2 * tokens * (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM * 2,
           [lambda i=i: apply_rotary(q[i], kk[i], pos, cache) for i in range(sets)])  # fmt: skip
    del q, kk
    # SiLU-and-mul: read [T, 2I], write [T, I]
    g = [b.randn(tokens, 2 * inter) for _ in range(sets)]
    o = torch.empty(tokens, inter, dtype=BF16, device=b.device)
    record(f"silu_and_mul T={tokens} I={inter}", 3 * tokens * inter * 2,
           [lambda i=i: silu_and_mul(g[i], out=o) for i in range(sets)])  # fmt: skip
    del g, o
    b.free()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench.json and bench.md")
    ap.add_argument("--quick", action="store_true", help="launcher defaults only, no config sweep")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in the CPU interpreter (checks the paths)")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --smoke for the CPU interpreter)")
    b = Bench(args.smoke)
    torch.manual_seed(0)
    res = {
        "device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": os.environ.get("COMMIT", "unknown"),
        "date": datetime.date.today().isoformat(),
    }
    res["ceilings"] = bench_ceilings(b)
    print(f"copy {res['ceilings']['copy_GBps']:.0f} GB/s, bf16 matmul {res['ceilings']['matmul_bf16_TFLOPs']:.0f} "
          "TFLOP/s", flush=True)  # fmt: skip
    res["decode"] = bench_decode(b, res["ceilings"], args.quick)
    res["decode_fp8"] = bench_decode_fp8(b, res["ceilings"])
    res["prefill"] = bench_prefill(b, res["ceilings"], args.quick)
    res["small"] = bench_small(b, res["ceilings"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "bench.md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
