cd /work/main
export OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2 GLOO_SOCKET_IFNAME=lo
for r in 0 1; do for order in zigzag batches; do
 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 -m flexgen_h2o.run --model smollm2-135m --input /tmp/scratch/p16.jsonl --output /tmp/scratch/pp-$order.jsonl --overwrite --gen-len 64 --hh-ratio 0.2 --gpu-batch-size 2 --num-gpu-batches 4 --no-progress --pipeline-stages 2 --stage-order $order --metrics-json /tmp/scratch/pp-$order-$r.json > /tmp/scratch/pp-$order-$r.log 2>&1
 python3 -c "import json; m=json.load(open('/tmp/scratch/pp-$order-$r.json')); print('round $r pipeline 2x4 $order: decode', round(m['decode_tok_s'],1), 'prefill', round(m['prefill_tok_s'],1), 'total', round(m['total_tok_s'],1))"
done; done
cmp <(python3 -c "import json;print([json.loads(l)['token_ids'] for l in open('/tmp/scratch/pp-zigzag.jsonl')])") <(python3 -c "import json;print([json.loads(l)['token_ids'] for l in open('/tmp/scratch/p16-8x1.jsonl')])") && echo same-zigzag
cmp <(python3 -c "import json;print([json.loads(l)['token_ids'] for l in open('/tmp/scratch/pp-batches.jsonl')])") <(python3 -c "import json;print([json.loads(l)['token_ids'] for l in open('/tmp/scratch/p16-8x1.jsonl')])") && echo same-batches
