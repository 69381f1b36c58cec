"""PNG plots of a run: latency CDFs and throughput over time (matplotlib, `pip install .[loadtest]`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from loadtest.backends import RequestRecord
from loadtest.report import METRICS, samples

_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "End-to-end latency"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def latency_cdfs(records: Sequence[RequestRecord], path: str, title: str = "") -> None:
    plt = _pyplot()
    s = samples(records)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, m in zip(axes.flat, METRICS):
        values = np.sort(np.asarray(s[m]) * 1000.0)
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
            for p in (50, 90, 99):
                ax.axvline(np.percentile(values, p), color="grey", linestyle=":", linewidth=0.8)
        ax.set_title(f"{_TITLES[m]} (n={len(values)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.suptitle(title or "Latency CDFs (dotted: p50, p90, p99)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput_over_time(records: Sequence[RequestRecord], t0: float, path: str, bin_s: float = 1.0,
                         title: str = "") -> None:
    """Output tokens/s and finished requests/s per time bin, and requests in flight."""
    plt = _pyplot()
    end = max((r.end - t0 for r in records), default=0.0)
    edges = np.arange(0.0, end + bin_s, bin_s)
    if len(edges) < 2:
        edges = np.array([0.0, bin_s])
    token_times, token_weights = [], []
    for r in records:
        if r.ok and r.chunk_times:
            # A chunk may carry several tokens; spread the request's count evenly over its chunks.
            w = r.output_tokens / len(r.chunk_times)
            token_times += [c - t0 for c in r.chunk_times]
            token_weights += [w] * len(r.chunk_times)
    tokens, _ = np.histogram(token_times, bins=edges, weights=token_weights)
    ok_done, _ = np.histogram([r.end - t0 for r in records if r.ok], bins=edges)
    failed, _ = np.histogram([r.end - t0 for r in records if not r.ok], bins=edges)
    mids = edges[:-1]
    in_flight = [sum(1 for r in records if r.start - t0 <= t < r.end - t0) for t in mids]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ax1.step(mids, tokens / bin_s, where="post", label="output tokens/s")
    ax1.set_ylabel("tokens/s")
    ax1.grid(alpha=0.3)
    ax1.legend(loc="upper left")
    ax2.step(mids, ok_done / bin_s, where="post", label="successful requests/s")
    if failed.any():
        ax2.step(mids, failed / bin_s, where="post", label="failed requests/s", color="tab:red")
    ax2.plot(mids, in_flight, label="requests in flight", color="tab:green", linestyle="--")
    ax2.set_xlabel("seconds since start")
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper left")
    fig.suptitle(title or f"Throughput over time ({bin_s:g} s bins)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(records: Sequence[RequestRecord], t0: float, out_dir: str, title: str = "") -> list[str]:
    """Writes both plots into `out_dir`; returns their paths (none if matplotlib is missing)."""
    try:
        _pyplot()
    except ImportError:
        return []
    paths = [os.path.join(out_dir, "latency_cdf.png"), os.path.join(out_dir, "throughput.png")]
    latency_cdfs(records, paths[0], title)
    throughput_over_time(records, t0, paths[1], title=title)
    return paths
