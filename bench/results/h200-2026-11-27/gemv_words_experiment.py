"""Experiment (kept with its results, not part of the product; README.md beside it): int4 GEMV reading 32-bit words, every nibble shifted straight into the mantissa of 1.0
(no per-byte extraction), the 8 nibble planes' products summed elementwise before one reduction a group."""
import os, sys, json, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch, triton, triton.language as tl
from kernels.quant_layout import pack_int
from kernels.quant_gemv import quant_gemv


@triton.jit
def gemv_words(x_ptr, y_ptr, qs_ptr, s_ptr, N, K, stride_qw, stride_s, ZERO: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    WORDS: tl.constexpr = BLOCK_K // 8
    NC: tl.constexpr = BLOCK_K // GROUP
    CW: tl.constexpr = GROUP // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n[:, None].to(tl.int64)
    q = tl.arange(0, WORDS)
    base_col = (q // 4) * 32 + 4 * (q % 4)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        word = tl.load(qs_ptr + rows * stride_qw + (k0 // 8 + q)[None, :])  # [BN, WORDS] int32
        prod = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        xs = tl.zeros((WORDS,), dtype=tl.float32)
        for i in tl.static_range(4):
            x_lo = tl.load(x_ptr + k0 + base_col + i).to(tl.float32)
            x_hi = tl.load(x_ptr + k0 + base_col + 16 + i).to(tl.float32)
            if 19 - 8 * i >= 0:
                b_lo = word << (19 - 8 * i)
            else:
                b_lo = word >> (8 * i - 19)
            if 15 - 8 * i >= 0:
                b_hi = word << (15 - 8 * i)
            else:
                b_hi = word >> (8 * i - 15)
            w_lo = ((b_lo & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
            w_hi = ((b_hi & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
            prod += w_lo * x_lo[None, :]
            prod += w_hi * x_hi[None, :]
            xs += x_lo + x_hi
        sums = tl.sum(tl.reshape(prod, (BLOCK_N, NC, CW)), axis=2)  # [BN, NC]
        x_sums = tl.sum(tl.reshape(xs, (NC, CW)), axis=1)  # [NC]
        scale = tl.load(s_ptr + rows * stride_s + (k0 // GROUP + tl.arange(0, NC))[None, :]).to(tl.float32)
        acc += tl.sum((sums * 16.0 - (16.0 + ZERO) * x_sums[None, :]) * scale, axis=1)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty))


def run_words(x, w, block_n, block_k, num_warps, out=None):
    n, k = w.shape
    out = torch.empty((1, n), dtype=x.dtype, device=x.device) if out is None else out
    qw = w.qs.view(torch.int32)
    opts = {} if os.environ.get("TRITON_INTERPRET") == "1" else {"num_warps": num_warps}
    gemv_words[(n // block_n,)](x, out, qw, w.scales, n, k, qw.stride(0), w.scales.stride(0), ZERO=float(w.zero),
                                BLOCK_N=block_n, BLOCK_K=block_k, GROUP=w.group_size, **opts)
    return out


def make_weight(n, k, device, dtype):
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, device=device)
    scales = (torch.rand(n, k // 128, device=device) * 0.02 + 0.001).to(dtype)
    return pack_int(codes, 4, 128, scales, zero=8)


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    if device == "cpu":  # interpreter check, small
        w = make_weight(32, 1024, device, torch.float32)
        x = torch.randn(1, 1024, dtype=torch.float32)
        ref = quant_gemv(x.to(dtype), w) if False else None
        from kernels.quant_layout import quant_matmul_ref
        exp = quant_matmul_ref(x.double(), w)
        got = run_words(x, w, 16, 1024, 4)
        print("interp max rel err", float((got.double() - exp).abs().max() / exp.abs().max()))
        return
    from triton.testing import do_bench_cudagraph
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    results = {}
    for name, (n, k) in shapes.items():
        w = make_weight(n, k, device, dtype)
        x = torch.randn(1, k, device=device, dtype=dtype)
        base = quant_gemv(x, w)
        t_base = do_bench_cudagraph(lambda: quant_gemv(x, w))
        nbytes = w.nbytes + x.nbytes
        row = {"base_us": t_base * 1e3, "base_gbs": nbytes / t_base / 1e6}
        best = None
        for bn in (8, 16, 32):
            for bk in (512, 1024, 2048):
                if k % bk or n % bn:
                    continue
                for nw in (4, 8):
                    try:
                        got = run_words(x, w, bn, bk, nw)
                        err = float((got.float() - base.float()).abs().max() / base.float().abs().max())
                        t = do_bench_cudagraph(lambda: run_words(x, w, bn, bk, nw))
                    except Exception as e:  # noqa: BLE001
                        print(name, bn, bk, nw, "failed", str(e)[:200], flush=True)
                        continue
                    if best is None or t < best[0]:
                        best = (t, bn, bk, nw, err)
        t, bn, bk, nw, err = best
        row.update({"words_us": t * 1e3, "words_gbs": nbytes / t / 1e6, "tile": [bn, bk, nw], "max_rel_diff": err,
                    "speedup": t_base / t})
        results[name] = row
        print(name, json.dumps(row), flush=True)
    tot_b = sum(r["base_us"] for r in results.values()) * 32
    tot_w = sum(r["words_us"] for r in results.values()) * 32
    print(f"32 layers: base {tot_b / 1e3:.2f} ms, words {tot_w / 1e3:.2f} ms")
    out = os.environ.get("OUT")
    if out:
        json.dump(results, open(os.path.join(out, "gemv_words.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
