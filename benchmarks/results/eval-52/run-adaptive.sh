#!/bin/bash
# Issue 52's second accuracy run: head-adaptive budgets (--head-budgets adaptive, AdaKV) beside the first run's rows
# (run.sh), same tasks, prompts and settings; then the first run's report merged again with these rows.
set -u
cd "$(dirname "$0")/../../.."
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
R=benchmarks/results/eval-52
E=".venv/bin/python -m flexgen_h2o.eval --model smollm2-135m --no-progress"
RULER="--tasks ruler --ruler-len 2048 --ruler-samples 10 --budgets 10%,20% --batch-size 10"
HAY="--tasks haystack --haystack-len 2048 --batch-size 11"
ADA=snapkv-adaptive,h2o-adaptive
$E $RULER --policies $ADA --out $R/ruler-c > $R/ruler-c.log 2>&1
$E $HAY --policies $ADA --budgets 10%,20% --out $R/haystack-b > $R/haystack-b.log 2>&1
$E --tasks perplexity --ppl-corpora wiki --policies $ADA --budgets 20% --batch-size 16 --out $R/ppl-b > $R/ppl-b.log 2>&1
$E --tasks summarization --sum-items 50 --policies snapkv-adaptive --budgets 20% --batch-size 10 --out $R/sum-b \
  > $R/sum-b.log 2>&1
$E --report-only --merge $R/ruler-a $R/ruler-b $R/ruler-c $R/haystack $R/haystack-b $R/ppl $R/ppl-b $R/sum $R/sum-b \
  $R/kvpress-ruler $R/kvpress-haystack --out $R
