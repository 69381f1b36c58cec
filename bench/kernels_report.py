"""The markdown table `bench/kernels_bench.py` writes as bench.md, from its JSON results."""

from __future__ import annotations


def markdown(res: dict) -> str:
    c = res["ceilings"]
    lines = [
        f"Device: {res['device']}; torch {res['torch']}, triton {res['triton']}; commit {res['commit']}; {res['date']}",
        "",
        f"Ceilings (same run): copy {c['copy_GBps']:.0f} GB/s (read + write); bf16 matmul 8192^3 "
        f"{c['matmul_bf16_TFLOPs']:.0f} TFLOP/s",
        "",
        "Decode attention, bf16, D=128, Hq=32/Hkv=8, block 16 (launcher defaults; best of the sweep in brackets):",
        "",
        "| batch | context | splits | time (us) | GB/s | % of copy | target | best sweep % (cfg, splits) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["decode"]:
        d, best = r["default"], r["best"]
        tgt = f">= {r['target_frac']:.0%}" if r["target_frac"] else "-"
        ok = "" if not r["target_frac"] else (" met" if d["frac_of_copy"] >= r["target_frac"] else " MISSED")
        lines.append(
            f"| {r['batch']} | {r['ctx']} | {r['auto_splits']} | {d['us']:.1f} | {d['GBps']:.0f} | "
            f"{d['frac_of_copy']:.0%} | {tgt}{ok} | {best['frac_of_copy']:.0%} ({best['block_n']},{best['num_warps']},"
            f"{best['num_stages']}; {best['splits']}) |"
        )  # fmt: skip
    if res.get("decode_fp8"):
        lines += ["", "Decode with fp8 KV (bytes actually moved):", "", "| batch | context | time (us) | GB/s | % of copy |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in res["decode_fp8"]:
            lines.append(f"| {r['batch']} | {r['ctx']} | {r['us']:.1f} | {r['GBps']:.0f} | {r['frac_of_copy']:.0%} |")
    lines += ["", "Prefill attention, causal, bf16, D=128, Hq=32/Hkv=8, block 16 (causal FLOPs):", "",
              "| batch x len | time (ms) | TFLOP/s | % of matmul | best sweep (cfg) | fp8 KV TFLOP/s | torch SDPA TFLOP/s |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["prefill"]:
        d, best = r["default"], r["best"]
        sd = f"{r['sdpa']['TFLOPs']:.0f}" if r["sdpa"] else "-"
        lines.append(
            f"| {r['batch']} x {r['len']} | {d['ms']:.3f} | {d['TFLOPs']:.0f} | {d['frac_of_matmul']:.0%} | "
            f"{best['TFLOPs']:.0f} ({best['block_m']},{best['block_n']},{best['num_warps']},{best['num_stages']}) | "
            f"{r['fp8']['TFLOPs']:.0f} | {sd} |"
        )  # fmt: skip
    lines += ["", "Small kernels:", "", "| kernel | time (us) | GB/s | % of copy |", "|---|---|---|---|"]
    for r in res["small"]:
        lines.append(f"| {r['kernel']} | {r['us']:.1f} | {r['GBps']:.0f} | {r['frac_of_copy']:.0%} |")
    return "\n".join(lines) + "\n"
