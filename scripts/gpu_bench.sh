#!/usr/bin/env bash
# The throughput suite on a CUDA machine (issue 8): FlexGen's headline shape, OPT-30B-shaped dummy weights
# (60 GB fp16) streamed from host RAM to one GPU, prompt 512 + gen 512. Ours (full cache, and H2O keeping 20 %)
# against the real flexgen==0.1.8 and DeepSpeed ZeRO-Inference (parameters offloaded to CPU), each at its best
# batch within the GPU's memory, interleaved repeats, same thread count for everyone.
#
#   bash scripts/gpu_bench.sh                       # results in benchmarks/results/gpu/ (results.md, PNGs, JSON)
#   REPEATS=2 OUT=/tmp/gpu bash scripts/gpu_bench.sh --max-probes 3
#
# Time: each of ours' processes builds its dummy weights in host RAM first (an OPT-6.7B process ran 118 s on an H200
# machine for 3 s of measured run; projected for OPT-30B, x4.5: about 8 minutes), and a decode step moves 60 GB
# over the link (>= 1.1 s at the measured 55 GB/s): plan for hours,
# or shorten it: --model opt-6.7b --gen-len 32 --batch ours-full=256 ours-h2o-20=1024 flexgen=32x8 deepspeed=128.
# A 15-minute lease holds scripts/gpu_check.sh instead.
#
# Needs: a CUDA GPU (80 GB class for OPT-30B's KV at useful batches), ~70 GB of free host RAM, this repo's
# environment with a CUDA build of torch, and `pip install flexgen==0.1.8 deepspeed` (a peer that is missing is
# a row in the table with the reason, never dropped). Extra arguments go to `python -m benchmarks.suite`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "error: torch sees no CUDA GPU here; run scripts/gpu_bench.sh on a GPU machine (CPU runs: python -m benchmarks.suite)" >&2
    exit 2
fi
for pkg in flexgen deepspeed; do
    if ! "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('$pkg') else 1)"; then
        echo "note: $pkg is not installed (pip install ${pkg/flexgen/flexgen==0.1.8}); its row will say so" >&2
    fi
done
# the budget every system gets: 90 % of the device (the rest is CUDA context and allocator slack)
GPU_GIB=$("$PY" -c "import torch; print(round(torch.cuda.get_device_properties(0).total_memory * 0.9 / 2**30, 1))")
THREADS=${THREADS:-$(nproc)}
echo "GPU: $("$PY" -c "import torch; print(torch.cuda.get_device_name(0))"), budget ${GPU_GIB} GiB, ${THREADS} CPU threads"
exec "$PY" -m benchmarks.suite --workload gpu-opt30b-512+512 --budget-gib "$GPU_GIB" --threads "$THREADS" \
    --repeats "${REPEATS:-1}" --out "${OUT:-benchmarks/results/gpu}" "$@"
