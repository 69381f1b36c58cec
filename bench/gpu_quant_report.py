"""The markdown report of `bench/gpu_quant.py`'s results (its JSON, as tables)."""

from __future__ import annotations

import json


def markdown(results: dict) -> str:
    env = results["env"]
    title = (f"# Quantized weight passes: {env['device']}, torch {env['torch']}, Triton {env['triton']}, "
             f"commit `{env['commit']}`, {env['date']}")
    lines = [title, ""]
    if "ceilings" in results:
        lines += [f"Copy bandwidth (read + write): **{results['ceilings']['copy_gbs']} GB/s**", ""]
    for key in ("pass_b1", "pass_b16", "pass_b64", "pass_b256"):
        if key not in results:
            continue
        header = ("| format | GB a step | pass (ms) | tok/s a sequence | tok/s all | GB/s | roofline tok/s | "
                  "% of roofline | vs bf16 | target |")
        lines += [f"## {key}", "", header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in results[key]:
            if "error" in r:
                lines.append(f"| {r['format']} | error: {r['error'][:120]} | | | | | | | | |")
                continue
            target = r.get("target_tok_s")
            verdict = "" if target is None else f"{target}: {'met' if r['tok_s_per_seq'] >= target else 'missed'}"
            lines.append(f"| {r['format']} | {r['gb_per_step']} | {r['pass_ms']} | {r['tok_s_per_seq']} | {r['tok_s_total']} | {r['gbs']} | "
                         f"{r['roofline_tok_s']} | {100 * r['ratio_to_roofline']:.0f}% | {r.get('speed_vs_bf16', '')} | "
                         f"{verdict} |")
        lines.append("")
    if results.get("crossover"):
        lines += ["## crossover (all layers' projections, ms)", "", "| format | rows | decode kernel | tensor cores |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {r['format']} | {r['rows']} | {r['decode_ms']} | {r['tensor_core_ms']} |" for r in results["crossover"]]
        lines.append("")
    for key in ("memory", "twins", "served"):
        if key in results:
            lines += [f"## {key}", "", "```", json.dumps(results[key], indent=1), "```", ""]
    if results.get("sweep"):
        lines += ["## sweep (batch 1 GEMV, best tile)", "", "| format | projection | N x K | tile | GB/s |",
                  "|---|---|---|---|---:|"]
        lines += [f"| {r['format']} | {r['projection']} | {r['n']} x {r['k']} | {r['block_n']} x {r['block_k']}, "
                  f"{r['num_warps']} warps | {r['gbs']} |" for r in results["sweep"] if r]
    if results.get("errors"):
        lines += ["## errors", "", "```", *results["errors"], "```"]
    return "\n".join(lines) + "\n"
