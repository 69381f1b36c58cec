"""Which Triton kernels a run compiled: the compile metadata of two Triton cache folders compared.

    TRITON_CACHE_DIR=/tmp/tc/start python bench/gpu_engine.py --only offline_fp8 --offline-requests 1 \
        --offline-lens 16,2
    cp -r /tmp/tc/start /tmp/tc/run
    TRITON_CACHE_DIR=/tmp/tc/run python bench/gpu_engine.py --only offline_fp8
    python bench/triton_cache_diff.py /tmp/tc/start /tmp/tc/run

Prints the count in each, and each kernel only the second holds (name, warps, stages): what compiled mid-run,
each a stall of its step (~1.4 s on an H100 for the attention kernels).
"""

from __future__ import annotations

import collections
import json
import os
import sys


def compiled_kernels(cache_dir: str) -> dict[str, tuple[str, dict]]:
    """{cache entry: (kernel name, launch metadata)} of a Triton cache folder."""
    kernels = {}
    for root, _, files in os.walk(cache_dir):
        for name in files:
            if not name.endswith(".json") or name.startswith("__grp__"):
                continue
            try:
                with open(os.path.join(root, name)) as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                continue
            kernels[os.path.basename(root)] = (meta.get("name"), {k: meta[k] for k in ("num_warps", "num_stages")
                                                                  if k in meta})
    return kernels


def main() -> None:
    before, after = compiled_kernels(sys.argv[1]), compiled_kernels(sys.argv[2])
    new = {key: value for key, value in after.items() if key not in before}
    print(f"kernels before {len(before)}, after {len(after)}, compiled in between {len(new)}")
    print(collections.Counter(name for name, _ in new.values()).most_common())
    for name, meta in sorted(new.values(), key=lambda item: item[0] or ""):
        print(name, json.dumps(meta))


if __name__ == "__main__":
    main()
