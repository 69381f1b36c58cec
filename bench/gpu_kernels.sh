#!/usr/bin/env bash
# One command on a CUDA machine: the full kernel test grid, then the kernel benchmarks.
#   COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_kernels.sh      # results under $OUT (default /tmp/kernel_results)
# TEST_TIMEOUT / BENCH_TIMEOUT (seconds) bound each part. Writes: env.txt, tests.txt (pytest), bench.txt, bench.json, bench.md. Exit status: tests' or bench's failure.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kernel_results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

{
  echo "commit: ${COMMIT:-unknown}"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# pytest-xdist spreads the compile-heavy grid over workers when it is installed
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n ${KERNEL_TEST_WORKERS:-8}")
SECONDS=0
timeout ${TEST_TIMEOUT:-0} $PY -m pytest tests/kernels -q -p no:cacheprovider --confcutdir=tests/kernels $XDIST -rfEs --durations=10 \
  -o addopts="" 2>&1 | tee "$OUT/tests.txt"
test_rc=${PIPESTATUS[0]}
echo "tests: rc=$test_rc in ${SECONDS}s"

SECONDS=0
timeout ${BENCH_TIMEOUT:-0} $PY bench/kernels_bench.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "bench: rc=$bench_rc in ${SECONDS}s"
echo "tests rc=$test_rc bench rc=$bench_rc"
[ "$test_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
