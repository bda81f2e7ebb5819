#!/bin/bash
# Issue 52's accuracy run: the question-aware rules beside the old ones and kvpress's presses, SmolLM2-135M, CPU.
# Two queues of one-thread processes on the 2-core VM; each step resumes if rerun. ruler-a and haystack ran first
# (their snapkv points were dropped and rerun after snapkv's default window became 32, ec6edbd and later).
set -u
cd "$(dirname "$0")/../../.."
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
R=benchmarks/results/eval-52
E=".venv/bin/python -m flexgen_h2o.eval --model smollm2-135m --no-progress"
RULER="--tasks ruler --ruler-len 2048 --ruler-samples 10 --budgets 10%,20% --batch-size 10"
HAY="--tasks haystack --haystack-len 2048 --batch-size 11"
(
  $E $RULER --policies full,h2o,h2o-avg,local --out $R/ruler-a > $R/ruler-a.log 2>&1
  $E $RULER --policies sink,snapkv,tova --out $R/ruler-b > $R/ruler-b.log 2>&1
  $E $HAY --policies full,h2o,h2o-avg,local,sink,snapkv,tova --budgets 10%,20% --out $R/haystack > $R/haystack.log 2>&1
  $E --tasks perplexity --ppl-corpora wiki --policies full,h2o,h2o-avg,local,sink,snapkv,tova --budgets 20% \
    --batch-size 16 --out $R/ppl > $R/ppl.log 2>&1
  $E $HAY --policies kvpress-snapkv,kvpress-adakv --budgets 20% --out $R/kvpress-haystack > $R/kvpress-haystack.log 2>&1
) &
(
  $E --tasks summarization --sum-items 50 --policies full,h2o,h2o-avg,local,sink,snapkv,tova --budgets 20% \
    --batch-size 10 --out $R/sum > $R/sum.log 2>&1
  $E $RULER --budgets 20% --policies kvpress-snapkv,kvpress-adakv --out $R/kvpress-ruler > $R/kvpress-ruler.log 2>&1
) &
wait
$E --report-only --merge $R/ruler-a $R/ruler-b $R/haystack $R/ppl $R/sum $R/kvpress-ruler $R/kvpress-haystack --out $R
