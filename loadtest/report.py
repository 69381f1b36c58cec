"""Turns request records into the numbers `vllm bench serve` reports (see loadtest/README.md).

Per successful request, with t0 = when it was sent and c_1..c_k = arrival times of the chunks that
carried output:

    TTFT = c_1 - t0                      E2EL = end - t0
    TPOT = (E2EL - TTFT) / (n_out - 1)   (requests with n_out > 1)
    ITL  = c_{i+1} - c_i                 (every gap of every request, pooled)

Throughputs divide totals over successful requests by the benchmark's duration (first send to
last end). Goodput counts successful requests meeting every given SLO, per second.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from loadtest.backends import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
PERCENTILES = (50, 90, 99)


def ttft(r: RequestRecord) -> float | None:
    return r.chunk_times[0] - r.start if r.chunk_times else None


def e2el(r: RequestRecord) -> float:
    return r.end - r.start


def tpot(r: RequestRecord) -> float | None:
    first = ttft(r)
    if first is None or r.output_tokens < 2:
        return None
    return (e2el(r) - first) / (r.output_tokens - 1)


def itls(r: RequestRecord) -> list[float]:
    return np.diff(r.chunk_times).tolist() if len(r.chunk_times) > 1 else []


def samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Each metric's samples in seconds, over successful requests."""
    ok = [r for r in records if r.ok]
    return {
        "ttft": [v for r in ok if (v := ttft(r)) is not None],
        "tpot": [v for r in ok if (v := tpot(r)) is not None],
        "itl": [v for r in ok for v in itls(r)],
        "e2el": [e2el(r) for r in ok],
    }


def stats_ms(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "std": float(a.std()),
            **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def parse_slos(specs: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 0.5, "tpot": 0.05} (values given in ms)."""
    slos = {}
    for spec in specs:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"SLO must look like ttft:MS, tpot:MS or e2el:MS, got {spec!r}")
        slos[name] = float(value) / 1000.0
    return slos


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    if not r.ok:
        return False
    values = {"ttft": ttft(r), "tpot": tpot(r), "e2el": e2el(r)}
    # NOTE: a one-token answer has no TPOT; it cannot miss a TPOT SLO.
    return all(values[k] is None or values[k] <= limit for k, limit in slos.items())


def summarize(records: Sequence[RequestRecord], duration: float, slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in records if r.ok]
    dur = max(duration, 1e-9)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    s = samples(records)
    summary = {
        "num_requests": len(records),
        "successful_requests": len(ok),
        "failed_requests": len(records) - len(ok),
        "errors_by_kind": dict(Counter(r.error_kind for r in records if not r.ok).most_common()),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / dur,
        "output_token_throughput": output_tokens / dur,
        "total_token_throughput": (prompt_tokens + output_tokens) / dur,
        **{f"{m}_ms": stats_ms(s[m]) for m in METRICS},
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in records)
        summary["slos_ms"] = {k: v * 1000 for k, v in slos.items()}
        summary["good_requests"] = good
        summary["request_goodput"] = good / dur
    return summary


def format_summary(summary: dict, title: str = "Load Test Result") -> str:
    """A console table in the layout `vllm bench serve` prints."""
    lines = [f"{title:=^56}"]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>16}")

    row("Successful requests:", summary["successful_requests"])
    row("Failed requests:", summary["failed_requests"])
    for kind, n in summary["errors_by_kind"].items():
        row(f"  {kind}:", n)
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if "request_goodput" in summary:
        row("Request goodput (req/s):", summary["request_goodput"])
        lines.append("  SLOs: " + ", ".join(f"{k} <= {v:g} ms" for k, v in summary["slos_ms"].items()))
    row("Output token throughput (tok/s):", summary["output_token_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for m in METRICS:
        lines.append(f"{_NAMES[m]:-^56}")
        st = summary[f"{m}_ms"]
        for key in ("mean", *(f"p{p}" for p in PERCENTILES)):
            label = "Mean" if key == "mean" else key.upper()
            row(f"{label} {m.upper()} (ms):", st[key] if st[key] is not None else "n/a")
    lines.append("=" * 56)
    return "\n".join(lines)


def record_dict(r: RequestRecord, t0: float) -> dict:
    """One request for the JSON results, times relative to the benchmark's start."""
    return {"index": r.index, "ok": r.ok, "error_kind": r.error_kind, "error": r.error or None,
            "start_s": r.start - t0, "ttft_s": ttft(r), "tpot_s": tpot(r), "e2el_s": e2el(r),
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "finish_reason": r.finish_reason,
            "chunk_offsets_s": [round(c - r.start, 6) for c in r.chunk_times]}
