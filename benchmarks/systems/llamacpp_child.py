"""One llama.cpp case: runs `llama-batched-bench` as a child, reads its JSONL result line, and writes the suite's
JSON (benchmarks/systems/llamacpp.py). Imports nothing from flexgen_h2o or benchmarks.

    python benchmarks/systems/llamacpp_child.py --bench BIN --model F.gguf --prompt-len 512 --gen-len 128 \
        --batch 32 --ctx 32768 --json out.json

Peak RSS is the benchmark process's own (its ru_maxrss, which is its VmHWM), the same measure as every other system.
Threads: OMP_NUM_THREADS (the suite's count) for both its prompt and its decode threads.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

# "llama_kv_cache:        CPU KV buffer size =   720.00 MiB": the cache it allocated (K and V, all layers)
KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([0-9.]+)\s*MiB")


def run(a: argparse.Namespace) -> dict:
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    # the prompt pass yields the first token, batched-bench's tg steps the other gen_len - 1 (base.rates)
    cmd = [a.bench, "-m", a.model, "-c", str(a.ctx), "-npp", str(a.prompt_len), "-ntg", str(a.gen_len - 1),
           "-npl", str(a.batch), "-t", str(threads), "-tb", str(threads), "-fa", "on", "-ngl", "0",
           "--output-format", "jsonl", "-lv", "4"]       # log level 4: its info lines, the KV buffer's size among them
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    # this process's only child, so the children's largest peak is the benchmark's own
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    lines = [ln for ln in (out + "\n" + err).splitlines() if ln.startswith("{") and '"speed_tg"' in ln]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((out + err).strip().splitlines()[-6:])
        raise SystemExit(f"error: llama-batched-bench exited {proc.returncode} without a result line "
                         f"(context {a.ctx} too small for {a.batch} x ({a.prompt_len} + {a.gen_len})?)\n{tail}")
    r = json.loads(lines[-1])
    kv = KV_BUFFER.findall(err + out)
    kv_bytes = sum(float(x) for x in kv) * (1 << 20)
    return {"batch": a.batch, "prompt_len": a.prompt_len, "gen_len": a.gen_len, "prefill_s": r["t_pp"],
            "decode_s": r["t_tg"], "peak_rss_bytes": rss, "n_ctx": r["n_kv_max"], "n_batch": r["n_batch"],
            "n_ubatch": r["n_ubatch"], "flash_attn": r["flash_attn"], "threads": r["n_threads"],
            "kv_cache_bytes": kv_bytes, "kv_bytes_per_seq": kv_bytes / a.batch if kv_bytes else None,
            "gguf_type": Path(a.model).suffixes[-2].lstrip(".") if len(Path(a.model).suffixes) > 1 else None,
            "bench_line": r, "command": cmd}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bench", required=True, help="the llama-batched-bench binary")
    p.add_argument("--model", required=True, help="the GGUF file")
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--gen-len", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--ctx", type=int, required=True, help="the whole context: batch x tokens per sequence")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    if a.gen_len < 2:
        print(f"error: --gen-len {a.gen_len}: needs at least 2 (the prompt pass and one decode step)",
              file=sys.stderr)
        return 2
    Path(a.json).write_text(json.dumps(run(a), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
