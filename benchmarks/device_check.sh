#!/usr/bin/env bash
# The whole GPU check in one command, from the repository root on the GPU machine:
#   bash benchmarks/device_check.sh
# No network and no installs there: the device brings torch, triton and numba; the package is
# used from src/ through PYTHONPATH. Each step runs under its own `timeout` (555 s in all,
# + 5 s grace each: < 10 min) and a failing step does not stop the next. Everything lands
# under $OUT (default benchmarks/results/device): a log per step, tune_triton.json (+ the
# default kernel's TTGIR), attention_cuda.json, device_check_summary.txt.
#   (a) the GPU tests: `-m gpu` over tests/ops, then test_triton.py natively on CUDA
#       (it interprets only when CUDA is absent; TRITON_INTERPRET must be unset here)
#   (b) the engine end to end on the Triton backend on CUDA (test_triton_engine.py: the
#       file that runs it under the interpreter on CPU; needs transformers for the models)
#   (c) benchmarks/tune_triton.py: launch-config sweep, v2 variant, probes, host cost
#   (d) benchmarks/bench_attention.py --device cuda on a bounded grid
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/device}"
mkdir -p "$OUT"
export OUT PYTHONPATH=src
unset TRITON_INTERPRET
SUMMARY="$OUT/device_check_summary.txt"
: >"$SUMMARY"

step() {  # step NAME SECONDS CMD...: run under a timeout, log to $OUT/NAME.log, note rc
    local name=$1 limit=$2
    shift 2
    echo "=== $name (timeout ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$SUMMARY"
}

{
    date -u
    git rev-parse HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true
    python -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/environment.txt"

if python -c "import pytest" 2>/dev/null; then
    step tests_gpu 100 python -m pytest -q -p no:cacheprovider tests/ops -m gpu
    step tests_triton 110 python -m pytest -q -p no:cacheprovider tests/ops/test_triton.py
    if python -c "import transformers" 2>/dev/null; then
        step tests_engine_triton 80 python -m pytest -q -p no:cacheprovider \
            tests/engine/test_triton_engine.py
    else
        echo "engine test skipped: transformers is not installed here" | tee -a "$SUMMARY"
    fi
else
    echo "tests skipped: pytest is not installed on this machine" | tee -a "$SUMMARY"
fi
step tune_triton 175 python benchmarks/tune_triton.py --budget-s 125
step bench_attention 90 python benchmarks/bench_attention.py --device cuda \
    --batch 1 8 64 --context 4096 32768 --block-size 16 --dtype bfloat16 \
    --max-prefill-context 4096 --min-time 0.1 --out-dir "$OUT"
cat "$SUMMARY"
