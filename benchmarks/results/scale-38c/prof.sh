cd /work/main
export OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
python3 - <<'P'
import json
from flexgen_h2o.frontends.corpus import lee_articles
open('/tmp/scratch/p16.jsonl','w').write("".join(json.dumps({"id": i, "prompt": " ".join(t.split()[:200])})+"\n" for i,t in enumerate(lee_articles()[:16])))
P
for r in 0 1; do for shape in "8 1" "2 4"; do set -- $shape
 .venv/bin/python -m flexgen_h2o.run --model smollm2-135m --input /tmp/scratch/p16.jsonl --output /tmp/scratch/p16-$1x$2.jsonl --overwrite --gen-len 64 --hh-ratio 0.2 --gpu-batch-size $1 --num-gpu-batches $2 --no-refill --no-progress --metrics-json /tmp/scratch/m-$1x$2-$r.json > /dev/null 2>&1
 python3 -c "import json; m=json.load(open('/tmp/scratch/m-$1x$2-$r.json')); print('round $r gbs $1 x $2: decode', round(m['decode_tok_s'],1), 'prefill', round(m['prefill_tok_s'],1), 'total', round(m['total_tok_s'],1))"
done; done
