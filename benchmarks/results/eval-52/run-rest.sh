#!/bin/bash
# Issue 52's second and third accuracy runs, on the first run's (run.sh) items. "adaptive": the head-adaptive rows
# (--head-budgets adaptive, AdaKV) on every task. "a" and "b": the grid's missing points, perplexity and
# summarization at 10 % for every policy, kvpress's presses at 10 %, its TOVA and ObservedAttention presses at 20 %
# and its rows on summarization (the last were not run: NOTES.md), side by side as one-thread processes. "merge"
# merges every run's report (after the edits NOTES.md describes).
set -u
cd "$(dirname "$0")/../../.."
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
R=benchmarks/results/eval-52
E=".venv/bin/python -m flexgen_h2o.eval --model smollm2-135m --no-progress"
RULER="--tasks ruler --ruler-len 2048 --ruler-samples 10 --batch-size 10"
HAY="--tasks haystack --haystack-len 2048 --batch-size 11"
ALL=full,h2o,h2o-avg,local,sink,snapkv,tova,snapkv-adaptive
ADA=snapkv-adaptive,h2o-adaptive
case "${1:-}" in
adaptive)      # the second run: head-adaptive budgets (--head-budgets adaptive) on every task
  $E $RULER --budgets 10%,20% --policies $ADA --out $R/ruler-c > $R/ruler-c.log 2>&1
  $E $HAY --policies $ADA --budgets 10%,20% --out $R/haystack-b > $R/haystack-b.log 2>&1
  $E --tasks perplexity --ppl-corpora wiki --policies $ADA --budgets 20% --batch-size 16 --out $R/ppl-b \
    > $R/ppl-b.log 2>&1
  $E --tasks summarization --sum-items 50 --policies snapkv-adaptive --budgets 20% --batch-size 10 --out $R/sum-b \
    > $R/sum-b.log 2>&1
  ;;
a)
  $E --tasks perplexity --ppl-corpora wiki --policies $ALL --budgets 10% --batch-size 16 --out $R/ppl-10 \
    > $R/ppl-10.log 2>&1
  $E $HAY --policies kvpress-tova,kvpress-observed --budgets 10%,20% --out $R/kvpress-haystack-b \
    > $R/kvpress-haystack-b.log 2>&1
  $E $HAY --policies kvpress-snapkv,kvpress-adakv --budgets 10% --out $R/kvpress-haystack-10 \
    > $R/kvpress-haystack-10.log 2>&1
  $E $RULER --budgets 10% --policies kvpress-snapkv,kvpress-adakv --out $R/kvpress-ruler-10 \
    > $R/kvpress-ruler-10.log 2>&1
  ;;
b)
  $E --tasks summarization --sum-items 50 --policies $ALL --budgets 10% --batch-size 10 --out $R/sum-10 \
    > $R/sum-10.log 2>&1
  $E $RULER --budgets 20% --policies kvpress-tova,kvpress-observed --out $R/kvpress-ruler-b \
    > $R/kvpress-ruler-b.log 2>&1
  $E --tasks summarization --sum-items 50 --policies kvpress-snapkv,kvpress-adakv --budgets 20% --batch-size 10 \
    --out $R/kvpress-sum > $R/kvpress-sum.log 2>&1
  ;;
merge)
  runs=""
  for d in ruler-a ruler-b ruler-c haystack haystack-b ppl ppl-b ppl-10 sum sum-b sum-10 kvpress-ruler \
           kvpress-ruler-b kvpress-ruler-10 kvpress-sum kvpress-haystack kvpress-haystack-b kvpress-haystack-10; do
    [ -d $R/$d ] && runs="$runs $R/$d"
  done
  $E --report-only --merge $runs --out $R
  ;;
*) echo "usage: $0 adaptive|a|b|merge" >&2; exit 2 ;;
esac
