"""Layouts and tiles of the int4 tensor-core GEMM (`kernels/quant_gemm.py`) at 16-512 rows, against bf16 cuBLAS.

Variants of one kernel (constexpr switches):
  planes        (kernels.quant_gemm up to 16 rows) x [BM, BK/2] twice (the planes' strided views) @ w planes^T
  swap_planes   the weight is the left operand: acc [BN, BM] += w plane [BN, BK/2] @ x plane^T [BK/2, BM]
  natural       the planes joined into K order: one dot of x [BM, BK] @ w^T [BK, BN]
  swap_natural  both
  half_*        4-bit codes widened in bf16 (`quant_layout.half_planes`) instead of fp32
  half_pipe_*   K order, the next K tile widened before this tile's dot (hand-pipelined)
  shipped       `kernels.quant_gemm` with its own tiles (`quant_gemm_config`)
  widened       `kernels.quant_widen.widened_matmul`: the weight widened to bf16, then cuBLAS
Each (variant, tile) compiles in a pool of processes first (Triton's disk cache), then every shape of
Llama-3-8B's projections is timed from CUDA graphs (weights rotated past L2). Prints the best tile of each
variant per (rows, projection) and each variant's sum over a layer against bf16's.

Usage: python bench/quant_gemm_tune.py --out DIR [--rows 16,64,256] [--variants ...]   (CUDA, < 10 minutes)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels._common import cast, dot_upcast, mma  # noqa: E402
from kernels.quant_gemm import quant_gemm  # noqa: E402
from kernels.quant_layout import (  # noqa: E402
    IntPackedWeight,
    act_planes,
    dequantize_int,
    kernel_args,
    planes_in_k_order,
    tile_for,
)
from kernels.quant_widen import widened_matmul  # noqa: E402

PROJECTIONS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
# name: (swap, natural, half, pipelined)
VARIANTS = {"planes": (False, False, False, False), "swap_planes": (True, False, False, False),
            "natural": (False, True, False, False), "swap_natural": (True, True, False, False),
            "half_planes": (False, False, True, False), "half_swap_planes": (True, False, True, False),
            "half_natural": (False, True, True, False), "half_swap_natural": (True, True, True, False),
            "half_pipe_natural": (False, True, True, True), "half_pipe_swap_natural": (True, True, True, True)}
FIXED_VARIANTS = ("shipped", "widened")  # no tiles to sweep


@triton.jit
def _tile_start(x_ptr, M, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """(offs_m, offs_n, m_mask, x row offsets, a zero accumulator: [BN, BM] when SWAP, else [BM, BN])."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return offs_m, offs_n, offs_m < M, offs_m.to(tl.int64) * stride_xm, acc


@triton.jit
def _k_order_dot(x_ptr, rows, m_mask, cols, w, acc, SWAP: tl.constexpr, UPCAST: tl.constexpr):
    """acc + x[:, cols] @ w^T (w [BN, BK] in K order), or its transpose when SWAP."""
    if SWAP:
        xt = tl.load(x_ptr + rows[None, :] + cols[:, None], mask=m_mask[None, :], other=0.0)
        return mma(w, xt, acc, 'tf32', UPCAST)
    else:
        xx = tl.load(x_ptr + rows[:, None] + cols[None, :], mask=m_mask[:, None], other=0.0)
        return mma(xx, tl.trans(w), acc, 'tf32', UPCAST)


@triton.jit
def _store_tile(y_ptr, acc, offs_m, offs_n, m_mask, N, stride_ym, SWAP: tl.constexpr):
    y_rows = offs_m.to(tl.int64) * stride_ym
    if SWAP:
        tl.store(y_ptr + y_rows[None, :] + offs_n[:, None], cast(acc, y_ptr.dtype.element_ty),
                 mask=m_mask[None, :] & (offs_n[:, None] < N))
    else:
        tl.store(y_ptr + y_rows[:, None] + offs_n[None, :], cast(acc, y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & (offs_n[None, :] < N))


@triton.jit
def _variant_kernel(x_ptr, y_ptr, qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, stride_qs, stride_qh, stride_s,
                    M, N, K, stride_xm, stride_ym,
                    BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    CHUNK: tl.constexpr, GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr,
                    SWAP: tl.constexpr, NATURAL: tl.constexpr, HALF: tl.constexpr,
                    UPCAST: tl.constexpr, TILE_N: tl.constexpr = 0):
    offs_m, offs_n, m_mask, rows, acc = _tile_start(x_ptr, M, stride_xm, BLOCK_M, BLOCK_N, SWAP)
    act = x_ptr.dtype.element_ty
    for k0 in range(0, K, BLOCK_K):
        w_lo, w_hi, cols_lo, cols_hi, in_k = act_planes(
            qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0, N, K, stride_qs, stride_qh, stride_s, BITS, GROUP,
            ZERO, HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP, HALF, act, TILE_N=TILE_N)
        if NATURAL:
            w = planes_in_k_order(w_lo, w_hi, BLOCK_N, BLOCK_K)
            acc = _k_order_dot(x_ptr, rows, m_mask, k0 + tl.arange(0, BLOCK_K), w, acc, SWAP, UPCAST)
        else:
            if SWAP:
                xt_lo = tl.load(x_ptr + rows[None, :] + cols_lo[:, None], mask=m_mask[None, :], other=0.0)
                xt_hi = tl.load(x_ptr + rows[None, :] + cols_hi[:, None], mask=m_mask[None, :], other=0.0)
                acc = mma(w_lo, xt_lo, acc, 'tf32', UPCAST)
                acc = mma(w_hi, xt_hi, acc, 'tf32', UPCAST)
            else:
                x_lo = tl.load(x_ptr + rows[:, None] + cols_lo[None, :], mask=m_mask[:, None], other=0.0)
                x_hi = tl.load(x_ptr + rows[:, None] + cols_hi[None, :], mask=m_mask[:, None], other=0.0)
                acc = mma(x_lo, tl.trans(w_lo), acc, 'tf32', UPCAST)
                acc = mma(x_hi, tl.trans(w_hi), acc, 'tf32', UPCAST)
    _store_tile(y_ptr, acc, offs_m, offs_n, m_mask, N, stride_ym, SWAP)


@triton.jit
def _pipelined_kernel(x_ptr, y_ptr, qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, stride_qs, stride_qh, stride_s,
                      M, N, K, stride_xm, stride_ym,
                      BITS: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      HAS_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, GROUP_STEP: tl.constexpr, HI_GROUP: tl.constexpr,
                      SWAP: tl.constexpr, HALF: tl.constexpr, UPCAST: tl.constexpr, TILE_N: tl.constexpr = 0):
    """The K-order variants with the next K tile widened before this tile's dot (carried across the loop),
    so the dot's asynchronous MMA has the next tile's integer work to overlap."""
    offs_m, offs_n, m_mask, rows, acc = _tile_start(x_ptr, M, stride_xm, BLOCK_M, BLOCK_N, SWAP)
    act = x_ptr.dtype.element_ty
    w_lo, w_hi, _, _, _ = act_planes(
        qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, 0, N, K, stride_qs, stride_qh, stride_s, BITS, GROUP,
        ZERO, HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP, HALF, act, TILE_N=TILE_N)
    for k0 in range(0, K, BLOCK_K):
        w = planes_in_k_order(w_lo, w_hi, BLOCK_N, BLOCK_K)
        # past the last tile every load is masked (zeros): no bounds check needed
        w_lo, w_hi, _, _, _ = act_planes(
            qs_ptr, qh_ptr, s_ptr, z_ptr, o_ptr, offs_n, k0 + BLOCK_K, N, K, stride_qs, stride_qh, stride_s, BITS,
            GROUP, ZERO, HAS_ZEROS, HAS_OFFSETS, BLOCK_N, BLOCK_K, CHUNK, GROUP_STEP, HI_GROUP, HALF, act,
            TILE_N=TILE_N)
        acc = _k_order_dot(x_ptr, rows, m_mask, k0 + tl.arange(0, BLOCK_K), w, acc, SWAP, UPCAST)
    _store_tile(y_ptr, acc, offs_m, offs_n, m_mask, N, stride_ym, SWAP)


def gptq_weight(n: int, k: int, device: str = "cuda", zeros: bool = False) -> IntPackedWeight:
    """Random int4 codes in the GPTQ layout (group 128, fp16 scales, constant zero 8) or, with `zeros`, AWQ's
    (a zero a group)."""
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)
    scales = (torch.rand(n, k // 128, device=device) * 0.002).to(torch.float16)
    zero_plane = torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, device=device) if zeros else None
    return IntPackedWeight(4, 128, qs, scales, zeros=zero_plane, zero=8)


def launch(x: torch.Tensor, w: IntPackedWeight, out: torch.Tensor, variant: str, config: dict, warmup: bool = False):
    swap, natural, half, pipelined = VARIANTS[variant]
    block_m, block_n, block_k, num_warps, num_stages = config["tile"]
    block_k, chunking = tile_for(w, block_k)
    args, consts = kernel_args(w)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(w.shape[0], block_n))
    kernel = _pipelined_kernel if pipelined else _variant_kernel
    call = kernel.warmup if warmup else kernel.__getitem__(grid)
    extra = {"grid": grid} if warmup else {}
    variant_args = {"SWAP": swap, "HALF": half} if pipelined else {"SWAP": swap, "NATURAL": natural, "HALF": half}
    return call(x, out, *args, x.shape[0], w.shape[0], w.shape[1], x.stride(0), out.stride(0), **consts,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **chunking, **variant_args,
                UPCAST=dot_upcast(), num_warps=num_warps, num_stages=num_stages, **extra)


def _compile(job: tuple[str, dict]) -> str | None:
    """In a pool process: compile one (variant, tile) into Triton's cache; an error's text, else None."""
    variant, config = job
    try:
        w = gptq_weight(256, 512)
        x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
        launch(x, w, torch.empty(64, 256, device="cuda", dtype=torch.bfloat16), variant, config, warmup=True)
        return None
    except Exception as exc:  # noqa: BLE001 - a tile past the shared memory or registers
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def graph_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=30, return_mode="median") * 1e3 / calls


def tiles_for_rows(num_rows: int, args: argparse.Namespace) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) worth trying at `num_rows` rows."""
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    block_ms = [bm for bm in ints(args.block_m) if bm <= max(16, num_rows) and bm * 8 >= num_rows]
    return [(bm, bn, bk, nw, ns) for bm, bn, bk, nw, ns in itertools.product(
        block_ms, ints(args.block_n), ints(args.block_k), ints(args.warps), ints(args.stages)) if bm * bn <= 256 * 128]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="16,64,256")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--zeros", action="store_true", help="AWQ's zero points (a zero a group) instead of GPTQ's 8")
    p.add_argument("--block-m", default="16,32,64,128,256")
    p.add_argument("--block-n", default="64,128,256")
    p.add_argument("--block-k", default="64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="3")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop timing new tiles after this long")
    args = p.parse_args()
    start = time.time()
    row_counts = [int(r) for r in args.rows.split(",")]
    variants = args.variants.split(",")
    jobs = sorted({(v, t) for r in row_counts for v in variants if v not in FIXED_VARIANTS
                   for t in tiles_for_rows(r, args)})
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(12, os.cpu_count() or 1), mp_context=ctx) as pool:
        errors = dict(zip(jobs, pool.map(_compile, [(v, {"tile": t}) for v, t in jobs])))
    print(f"compiled {len(jobs)} kernels in {time.time() - start:.0f} s; "
          f"{sum(e is not None for e in errors.values())} failed", flush=True)
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": {}}
    for num_rows in row_counts:
        per_rows = results["rows"][num_rows] = {}
        for name, n, k in PROJECTIONS:
            copies = max(2, (192 << 20) // (n * k // 2))
            ws = [gptq_weight(n, k, zeros=args.zeros) for _ in range(copies)]
            x = torch.randn(num_rows, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(num_rows, n, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ dequantize_int(ws[0], torch.float64).T
            bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies // 4))]
            row = {"bf16_us": round(graph_us(lambda: [torch.matmul(x, w.T, out=out) for w in bf16], len(bf16)), 1)}
            fixed = {"shipped": quant_gemm, "widened": widened_matmul}  # quant_gemm: its own tiles
            for variant in (v for v in variants if v in FIXED_VARIANTS):
                fn = fixed[variant]
                fn(x, ws[0], out=out)
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                us = graph_us(lambda fn=fn: [fn(x, w, out=out) for w in ws], len(ws))
                row[variant] = {"us": round(us, 1), "tile": variant, "rel_err": f"{err:.2e}"}
            for variant in (v for v in variants if v not in FIXED_VARIANTS):
                best = None
                for tile in tiles_for_rows(num_rows, args):
                    if errors.get((variant, tile)) or time.time() - start > args.budget_s:
                        continue
                    config = {"tile": tile}
                    try:
                        launch(x, ws[0], out, variant, config)
                    except Exception as exc:  # noqa: BLE001 - past the shared memory (found at launch)
                        errors[(variant, tile)] = f"{type(exc).__name__}"
                        continue
                    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    if err > 2e-2:
                        print(f"{variant} {tile}: wrong, relative error {err:.3g}", flush=True)
                        continue
                    us = graph_us(lambda: [launch(x, w, out, variant, config) for w in ws], len(ws))
                    if best is None or us < best["us"]:
                        best = {"us": round(us, 1), "tile": tile}
                row[variant] = best
            per_rows[name] = row
            print(num_rows, name, row, flush=True)
            ws.clear()
            bf16.clear()
            torch.cuda.empty_cache()
        totals = {"bf16_us": round(sum(r["bf16_us"] for r in per_rows.values()), 1)}
        for variant in variants:
            if all(per_rows[name].get(variant) for name, _, _ in PROJECTIONS):
                totals[variant] = round(sum(per_rows[name][variant]["us"] for name, _, _ in PROJECTIONS), 1)
        per_rows["layer_total_us"] = totals
        print(num_rows, "layer total", totals, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quant_gemm_tune.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
