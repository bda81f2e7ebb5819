#!/usr/bin/env bash
# Where our prompt pass on a GPU spends its time (the 2026-11-26 H100 lease: ours 51-67k prompt tok/s against
# FlexGen's 117-119k and DeepSpeed's 168-177k at the same OPT-1.3B shape), and the xdist abort's message:
#   1. the machine's constants (for the prompt pass's roofline bound);
#   2. torch's profiler over the prompt pass of gpu_check.sh's shape (OPT-1.3B dummy weights streamed from
#      pinned host RAM, 256 x 512), full cache and H2O: kernel time per op group against the wall time, and a
#      Chrome trace of each (trace_full.json, trace_h2o.json) for the gaps between kernels;
#   3. our full cache at FlexGen's block shape, 32 x 8 sequences;
#   4. the CUDA tests under xdist with -s (the case that aborted workers; the C++ message should reach the log).
#
#   bash scripts/gpu_profile.sh [OUT]        # default benchmarks/results/gpu-profile
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu-profile}
source scripts/gpu_steps.sh
step machine 60 "$PY" -m benchmarks.machine --json "$OUT/machine.json" --threads "$(nproc)"
step prefill ${PREFILL_LIMIT:-200} "$PY" -m benchmarks.studies.profile_decode --device cuda --phase prefill \
    --model opt-1.3b --dummy-weights --percent 0 100 100 0 100 0 --batch 256 --prompt-len 512 --cases full h2o \
    --hh-size 51 --recent-size 51 --threads "$(nproc)" --machine-json "$OUT/machine.json" --out "$OUT/prefill"
# our full cache at FlexGen's block shape (32 x 8), against gpu_check.sh's 256 x 1: does the GPU batch matter?
step ours_32x8 90 "$PY" -m flexgen_h2o.run --model opt-1.3b --dummy-weights --device cuda --percent 0 100 100 0 100 0 \
    --prompt-len 512 --gen-len 32 --gpu-batch-size 32 --num-gpu-batches 8 --full-cache --no-progress \
    --metrics-json "$OUT/ours_32x8.json"
step gpu_tests 120 "$PY" -m pytest -q -p no:cacheprovider -s $XDIST tests/test_cuda.py tests/memory/test_backend.py
echo "$failed step(s) failed; logs in $OUT"
exit "$failed"
