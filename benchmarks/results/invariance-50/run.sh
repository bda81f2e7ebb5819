#!/usr/bin/env bash
# The batch-invariant path's cost: SmolLM2-135M in benchmark mode, FLEXGEN_H2O_BATCH_INVARIANT=1 (the default)
# against 0, interleaved, REPS rounds. Shapes: h2o = s2048 H2O 20 % at batch 16, full = s512 full cache at batch
# 52, disk = s512 H2O 20 % at batch 52 with the KV on disk (staged windows). 32 new tokens: the decode step's time
# is read per step (decode_s / 31). Usage: bash run.sh OUT_DIR [REPS] [SHAPES...]
set -u
OUT=${1:?out dir}; REPS=${2:-2}; shift 2 2>/dev/null; SHAPES=${*:-h2o full disk}
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT"
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
for rep in $(seq "$REPS"); do
  for shape in $SHAPES; do
    case $shape in
      h2o) args="--prompt-len 2048 --gpu-batch-size 16 --hh-ratio 0.2" ;;
      full) args="--prompt-len 512 --gpu-batch-size 52" ;;
      disk) args="--prompt-len 512 --gpu-batch-size 52 --hh-ratio 0.2 --percent 100 0 0 0 100 0" ;;
    esac
    for inv in 1 0; do
      name=$shape-inv$inv-rep$rep
      FLEXGEN_H2O_BATCH_INVARIANT=$inv .venv/bin/python -m flexgen_h2o.run --model smollm2-135m $args --gen-len 32 \
        --offload-dir "$OUT/offload" --no-warmup --no-progress --metrics-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      echo "$name rc=$?"
    done
  done
done
.venv/bin/python - "$OUT" <<'PY'
import glob, json, os, sys
rows = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    shape, inv, rep = os.path.basename(f)[:-5].split("-")
    m = json.load(open(f))
    rows.setdefault((shape, rep), {})[inv] = (m["prefill_s"], m["decode_s"] / 31 * 1000)
print("| shape | round | prompt pass s (inv / off = ratio) | decode ms/step (inv / off = ratio) |")
print("|---|---|---|---|")
for (shape, rep), r in sorted(rows.items()):
    if {"inv1", "inv0"} <= set(r):
        (p1, d1), (p0, d0) = r["inv1"], r["inv0"]
        print(f"| {shape} | {rep} | {p1:.1f} / {p0:.1f} = {p1 / p0:.3f} | {d1:.0f} / {d0:.0f} = {d1 / d0:.3f} |")
PY
