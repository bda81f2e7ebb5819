#!/bin/bash
# Issue 53's accuracy run: page selection (`--kv-select pages`, 32-token pages) at 10 % and 20 % on the grid of
# eval-52, whose rows (full, h2o, snapkv, ...) it is merged with: `pages-bound` (Quest's bound, `--page-score
# bound`) ran first (`bound`), then `pages` (`--page-score keys`, the default), then `pages-ahead` (`--page-ahead`:
# each layer's pages chosen from the previous layer's input, `ahead`). SmolLM2-135M, CPU, two queues of
# one-thread processes on the 2-core VM; each step resumes if rerun. `merge` writes report.md and the PNGs.
set -u
cd "$(dirname "$0")/../../.."
export OMP_WAIT_POLICY=PASSIVE HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
R=benchmarks/results/eval-53
P=benchmarks/results/eval-52
E=".venv/bin/python -m flexgen_h2o.eval --model smollm2-135m --no-progress --budgets 10%,20%"
grid() {   # $1: the grid row, $2: folder suffix
  (
    $E --policies $1 --tasks ruler --ruler-len 2048 --ruler-samples 10 --batch-size 10 --out $R/ruler$2 \
      > $R/ruler$2.log 2>&1
    $E --policies $1 --tasks haystack --haystack-len 2048 --batch-size 11 --out $R/haystack$2 > $R/haystack$2.log 2>&1
    $E --policies $1 --tasks perplexity --ppl-corpora wiki --batch-size 16 --out $R/ppl$2 > $R/ppl$2.log 2>&1
  ) &
  $E --policies $1 --tasks summarization --sum-items 50 --batch-size 10 --out $R/sum$2 > $R/sum$2.log 2>&1 &
  wait
}
case "${1:-}" in
bound) grid pages-bound -bound ;;
keys) grid pages "" ;;
ahead) grid pages-ahead -ahead ;;
merge)
  runs=""
  for d in $P/ruler-a $P/ruler-b $P/ruler-c $P/haystack $P/haystack-b $P/ppl $P/ppl-b $P/ppl-10 $P/sum $P/sum-b \
           $P/sum-10 $P/kvpress-ruler $P/kvpress-ruler-10 $P/kvpress-haystack $P/kvpress-haystack-10 \
           $R/ruler-bound $R/haystack-bound $R/ppl-bound $R/sum-bound $R/ruler $R/haystack $R/ppl $R/sum; do
    [ -d $d ] && runs="$runs $d"
  done
  if [ -z "$runs" ]; then     # the sub-runs left the tree after the first merge: its JSON stands for them
    mkdir -p /tmp/eval-53-merged && cp $R/*.json /tmp/eval-53-merged/ && runs=/tmp/eval-53-merged
  fi
  for d in $R/ruler-ahead $R/haystack-ahead $R/ppl-ahead $R/sum-ahead; do
    [ -d $d ] && runs="$runs $d"
  done
  .venv/bin/python -m flexgen_h2o.eval --report-only --merge $runs --out $R
  ;;
*) echo "usage: $0 bound|keys|ahead|merge" >&2; exit 2 ;;
esac
