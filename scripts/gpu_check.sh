#!/usr/bin/env bash
# The short GPU check: what a 15-minute GPU lease can hold, most important first, each step with its own time
# limit, logging to OUT as it goes (a lease that ends mid-way still leaves the finished steps' logs).
#   1. the chunked-prefill cases (every tier in use; the one that aborted xdist workers on both 2026-11-26
#      leases), alone in one process with CUDA_LAUNCH_BLOCKING=1;
#   2. the CUDA tests: the fp16 path against the fp32 CPU engine (tests/test_cuda.py, the backend round trip),
#      with -s, so that the C++ message before an abort (glibc's, or std::terminate's) reaches the log;
#   3. the machine's constants (benchmarks.machine: host->device link, device memory, fp16 GEMM);
#   4. OPT-1.3B-shaped dummy weights streamed from host RAM (--percent 0 100 100 0 100 0), prompt 512 + gen 32,
#      ROUNDS interleaved rounds (A B C D, A B C D): ours with the full cache, FlexGen 0.1.8 and DeepSpeed
#      ZeRO-Inference (parameters offloaded to CPU) at the same 256 sequences, ours with H2O at 1024;
#   5. the same shape compressed (issue 34): ours with --compress-weight --compress-cache (int4, full cache and
#      H2O) against FlexGen 0.1.8's own --compress-weight --compress-cache, one round;
#   6. page selection (issue 53), OPT-1.3B-shaped with its KV homed in host RAM: the full cache, --kv-select pages
#      --fetch-ratio 0.2 (and with --page-ahead: does reading a layer ahead pay where pages cross the link?) and
#      H2O-20, one round at batch 64;
#   7. the placement and H2O suites on the GPU in fp32 (FLEXGEN_H2O_TEST_DEVICE=cuda), with -s too: H2O's
#      decode half against the reference on every tier, H2O with --cpu-cache-compute (the real split there),
#      batch invariance, the head-adaptive (ragged) cache's torch path and page selection against the reference.
#
#   bash scripts/gpu_check.sh [OUT]          # logs and JSON in OUT (default benchmarks/results/gpu-check)
#   ROUNDS=1 bash scripts/gpu_check.sh       # one round of step 4 (default 2)
#   STEPS="gpu_tests bench" bash scripts/gpu_check.sh   # only these (chunked gpu_tests machine bench compressed
#                                                       # pages fp32_tests)
#
# Needs: a CUDA build of torch, transformers, pytest (pytest-xdist for -n), `pip install flexgen==0.1.8
# deepspeed` for their rows, and the converted SmolLM2 tokenizer and the gensim test data that the benchmark
# prompts come from. A step that fails is counted and the next one runs; the exit status is the number of
# failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu-check}
source scripts/gpu_steps.sh
STEPS=" ${STEPS:-chunked gpu_tests machine bench compressed pages fp32_tests} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
want chunked && step chunked 120 env FLEXGEN_H2O_TEST_DEVICE=cuda CUDA_LAUNCH_BLOCKING=1 "${PYTEST[@]}" -x \
    tests/test_equivalence.py tests/test_cuda.py -k chunked
want gpu_tests && step gpu_tests 150 "${PYTEST[@]}" -s $XDIST tests/test_cuda.py tests/memory/test_backend.py
want machine && step machine 60 "$PY" -m benchmarks.machine --json "$OUT/machine.json" --threads "$(nproc)"
SHAPE=(--model opt-1.3b --dummy-weights --device cuda --percent 0 100 100 0 100 0 --prompt-len 512 --gen-len 32)
want bench && for round in $(seq 1 "${ROUNDS:-2}"); do
    step "ours_full_$round" 90 "$PY" -m flexgen_h2o.run "${SHAPE[@]}" --gpu-batch-size 256 --full-cache \
        --no-progress --metrics-json "$OUT/ours_full_$round.json"
    step "flexgen_$round" 90 "$PY" -m benchmarks.systems.flexgen --model opt-1.3b --gbs 32 --num-gpu-batches 8 \
        --prompt-len 512 --gen-len 32 --percent 0 100 100 0 100 0 --json "$OUT/flexgen_$round.json"
    step "ours_h2o_$round" 90 "$PY" -m flexgen_h2o.run "${SHAPE[@]}" --gpu-batch-size 1024 --hh-ratio 0.1 \
        --no-progress --metrics-json "$OUT/ours_h2o_$round.json"
    step "deepspeed_$round" 120 "$PY" -m benchmarks.systems.deepspeed --model opt-1.3b --batch 256 \
        --prompt-len 512 --gen-len 32 --offload cpu --json "$OUT/deepspeed_$round.json"
done
want compressed && {
    COMPRESS=(--compress-weight --compress-cache)
    step ours_full_int4 90 "$PY" -m flexgen_h2o.run "${SHAPE[@]}" "${COMPRESS[@]}" --gpu-batch-size 256 --full-cache \
        --no-progress --metrics-json "$OUT/ours_full_int4.json"
    step flexgen_int4 90 "$PY" -m benchmarks.systems.flexgen --model opt-1.3b --gbs 32 --num-gpu-batches 8 \
        --prompt-len 512 --gen-len 32 --percent 0 100 100 0 100 0 "${COMPRESS[@]}" --json "$OUT/flexgen_int4.json"
    step ours_h2o_int4 90 "$PY" -m flexgen_h2o.run "${SHAPE[@]}" "${COMPRESS[@]}" --gpu-batch-size 1024 \
        --hh-ratio 0.1 --no-progress --metrics-json "$OUT/ours_h2o_int4.json"
}
want pages && {     # issue 53: the KV homed in host RAM, page selection reading a fifth of it per step
    HOST_KV=(--model opt-1.3b --dummy-weights --device cuda --percent 100 0 0 100 100 0 --prompt-len 512 --gen-len 32)
    step pages_full 90 "$PY" -m flexgen_h2o.run "${HOST_KV[@]}" --gpu-batch-size 64 --no-progress \
        --metrics-json "$OUT/pages_full.json"
    step pages_20 90 "$PY" -m flexgen_h2o.run "${HOST_KV[@]}" --gpu-batch-size 64 --kv-select pages \
        --fetch-ratio 0.2 --no-progress --metrics-json "$OUT/pages_20.json"
    step pages_20_ahead 90 "$PY" -m flexgen_h2o.run "${HOST_KV[@]}" --gpu-batch-size 64 --kv-select pages \
        --fetch-ratio 0.2 --page-ahead --no-progress --metrics-json "$OUT/pages_20_ahead.json"
    step pages_h2o_20 90 "$PY" -m flexgen_h2o.run "${HOST_KV[@]}" --gpu-batch-size 64 --hh-ratio 0.1 --no-progress \
        --metrics-json "$OUT/pages_h2o_20.json"
}
want fp32_tests && step fp32_tests 240 env FLEXGEN_H2O_TEST_DEVICE=cuda "${PYTEST[@]}" -s $XDIST \
    tests/test_equivalence.py tests/test_h2o_engine.py tests/test_h2o_decode.py tests/test_batch_invariance.py \
    tests/test_head_budgets.py::test_matches_the_reference tests/test_page_selection.py
echo "$failed step(s) failed; logs in $OUT"
exit "$failed"
