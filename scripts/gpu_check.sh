#!/usr/bin/env bash
# The short GPU check: what a 15-minute GPU lease can hold. Written after the 2026-11-26 lease from the steps run
# there as separate commands (about 5 minutes on an H200); the script itself has not run on a GPU yet.
#   1. the CUDA tests: the fp16 path against the fp32 CPU engine (tests/test_cuda.py, the backend round trip),
#      then the placement and H2O suites on the GPU in fp32 (FLEXGEN_H2O_TEST_DEVICE=cuda);
#   2. the machine's constants (benchmarks.machine: host->device link, device memory, fp16 GEMM);
#   3. OPT-1.3B-shaped dummy weights streamed from host RAM (--percent 0 100 100 0 100 0), prompt 512 + gen 32:
#      ours with the full cache and FlexGen 0.1.8 at the same 256 sequences, ours with H2O (20 %) at 1024.
#
#   bash scripts/gpu_check.sh [OUT]          # logs and JSON in OUT (default benchmarks/results/gpu-check)
#
# Needs: a CUDA build of torch, transformers, pytest (pytest-xdist for -n), `pip install flexgen==0.1.8` for its
# row, and the converted SmolLM2 tokenizer and the gensim test data that the benchmark prompts come from.
# Each step has its own time limit and goes on after a failure; the exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu-check}
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "error: torch sees no CUDA GPU here; scripts/gpu_check.sh is for a GPU machine (CPU: make test)" >&2
    exit 2
fi
mkdir -p "$OUT"
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
failed=0
step() {   # step NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, print the tail
    local name=$1 limit=$2; shift 2
    timeout -s INT "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc"; tail -6 "$OUT/$name.log"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}
step gpu_tests 150 "$PY" -m pytest -q -p no:cacheprovider $XDIST tests/test_cuda.py tests/memory/test_backend.py
step fp32_tests 150 env FLEXGEN_H2O_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider $XDIST \
    tests/test_equivalence.py tests/test_h2o_engine.py
step machine 60 "$PY" -m benchmarks.machine --json "$OUT/machine.json" --threads "$(nproc)"
SHAPE=(--model opt-1.3b --dummy-weights --device cuda --percent 0 100 100 0 100 0 --prompt-len 512 --gen-len 32)
step ours_full 120 "$PY" -m flexgen_h2o.run "${SHAPE[@]}" --gpu-batch-size 256 --full-cache --no-progress \
    --metrics-json "$OUT/ours_full.json"
step flexgen 120 "$PY" -m benchmarks.systems.flexgen --model opt-1.3b --gbs 32 --num-gpu-batches 8 \
    --prompt-len 512 --gen-len 32 --percent 0 100 100 0 100 0 --json "$OUT/flexgen.json"
step ours_h2o 120 "$PY" -m flexgen_h2o.run "${SHAPE[@]}" --gpu-batch-size 1024 --hh-ratio 0.1 --no-progress \
    --metrics-json "$OUT/ours_h2o.json"
echo "$failed step(s) failed; logs in $OUT"
exit "$failed"
