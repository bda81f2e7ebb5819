"""transformers `generate` with H2OCache against the same `generate` with DynamicCache at long context.

Cases, each in its own subprocess (so peak memory belongs to one case), alternated A B A B over the repeats:
- dynamic: SmolLM2-135M (real weights), transformers' default attention (sdpa) and DynamicCache;
- h2o:     the same model with attn_implementation="flexgen_h2o" and H2OCache(hh_ratio=r): r heavy hitters +
           r recent of the prompt per (sequence, KV head), i.e. a 2r budget (r = 0.1: the paper's "20 %").
Prompts: Lee news articles cut into windows of exactly prompt_len tokens (no padding), greedy, no EOS stop.
Timing: a LogitsProcessor stamps every generated token; prefill = generate start -> first token, decode = first
-> last token (gen_len - 1 steps). Memory: KV bytes held by the cache at the end (H2O counts its fp32 scores
and int32 positions too), and the peak RSS sampled every 2 ms during generate (CUDA: max_memory_allocated).
Token agreement: share of generated tokens equal to the dynamic run's, position by position.

    python -m benchmarks.hf_cache --quick      # 1024+64, batch 4, 2 repeats (~3 min on 2 cores)
    python -m benchmarks.hf_cache              # 2048+128, batch 8, 3 repeats
Results: benchmarks/results/hf_cache/{results.json,results.md,logs/} (git-ignored).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # the parent imports torch too; never spin-wait

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.common import CaseFailed, RssSampler, bench_env, interleaved, median, run_json  # noqa: E402
from benchmarks.systems.hf_generate import load_smollm2  # noqa: E402

CASES = ("dynamic", "h2o")
MIB, GIB = 1 << 20, 1 << 30


# --- one case (child process) ---

def run_case(a: argparse.Namespace) -> dict:
    import torch
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

    from flexgen_h2o.frontends.corpus import benchmark_prompts
    from flexgen_h2o.hf import H2OCache, enable_h2o

    torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.startswith("cuda") else torch.float32   # fp16 matmul is ~500x slower on CPU
    model, tok = load_smollm2(device, dtype)
    if a.case == "h2o":
        enable_h2o(model)
    ids = torch.tensor(benchmark_prompts(tok, a.batch, a.prompt_len, model.config.vocab_size), device=device)

    class Clock(LogitsProcessor):
        def __init__(self):
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            self.stamps.append(time.perf_counter())
            return scores

    def new_cache():
        return H2OCache(hh_ratio=a.hh_ratio) if a.case == "h2o" else DynamicCache()

    def generate(x, n, cache, processors=()):
        with torch.no_grad():
            return model.generate(x, attention_mask=torch.ones_like(x), cache=cache, max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=2, eos_token_id=None,
                                  logits_processor=LogitsProcessorList(list(processors)))

    generate(ids[:, :64], 4, new_cache())                # warm-up: allocator, kernels, lazy imports
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    clock, cache = Clock(), new_cache()
    with RssSampler(interval_s=0.002) as rss:
        t0 = time.perf_counter()
        out = generate(ids, a.gen_len, cache, [clock])
    s = clock.stamps
    prefill_s, decode_s = s[0] - t0, s[-1] - s[0]
    if a.case == "h2o":
        kv_bytes, slots = cache.nbytes, cache.layers[0].store.capacity
    else:
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        slots = cache.layers[0].keys.shape[2]
    return {"case": a.case, "device": device, "dtype": str(dtype), "batch": a.batch, "prompt_len": a.prompt_len,
            "gen_len": a.gen_len, "threads": a.threads, "slots_per_seq": slots, "kv_bytes": kv_bytes,
            "prefill_s": prefill_s, "decode_s": decode_s,
            "decode_tok_s": a.batch * (a.gen_len - 1) / decode_s,
            "total_tok_s": a.batch * a.gen_len / (s[-1] - t0),
            "peak_rss_bytes": rss.peak,
            "peak_cuda_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else None,
            "tokens": out[:, ids.shape[1]:].tolist()}


# --- the comparison (parent process) ---

def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for case, rs in runs.items():
        out[case] = {k: median([r[k] for r in rs]) for k in ("prefill_s", "decode_s", "decode_tok_s", "total_tok_s",
                                                             "peak_rss_bytes", "kv_bytes")}
        out[case]["slots_per_seq"] = rs[0]["slots_per_seq"]
        out[case]["decode_tok_s_runs"] = [round(r["decode_tok_s"], 2) for r in rs]
        if rs[0]["peak_cuda_bytes"] is not None:
            out[case]["peak_cuda_bytes"] = median([r["peak_cuda_bytes"] for r in rs])
    ref = runs["dynamic"][0]["tokens"]
    out["h2o"]["token_agreement"] = agreement(runs["h2o"][0]["tokens"], ref)
    d, h = out["dynamic"], out["h2o"]
    out["comparison"] = {"kv_reduction": 1 - h["kv_bytes"] / d["kv_bytes"],
                         "decode_speedup": h["decode_tok_s"] / d["decode_tok_s"],
                         "total_speedup": h["total_tok_s"] / d["total_tok_s"],
                         "peak_rss_ratio": h["peak_rss_bytes"] / d["peak_rss_bytes"]}
    return out


def markdown(s: dict, a: argparse.Namespace) -> str:
    d, h, c = s["dynamic"], s["h2o"], s["comparison"]
    rows = [("case", "slots/seq", "KV MiB", "prefill s", "decode tok/s (runs)", "total tok/s", "peak RSS GiB")]
    for name, r in (("hf + DynamicCache (sdpa)", d), (f"hf + H2OCache (hh_ratio {a.hh_ratio})", h)):
        rows.append((name, str(r["slots_per_seq"]), f"{r['kv_bytes'] / MIB:.1f}", f"{r['prefill_s']:.2f}",
                     f"{r['decode_tok_s']:.2f} ({', '.join(map(str, r['decode_tok_s_runs']))})",
                     f"{r['total_tok_s']:.2f}", f"{r['peak_rss_bytes'] / GIB:.3f}"))
    table = "\n".join("| " + " | ".join(row) + " |" for row in [rows[0], tuple("---" for _ in rows[0]), *rows[1:]])
    return (f"# hf + H2OCache vs hf + DynamicCache: SmolLM2-135M, {a.prompt_len}+{a.gen_len}, batch {a.batch}, "
            f"{a.repeats} repeat(s) interleaved, {a.threads} threads\n\n{table}\n\n"
            f"KV reduction {100 * c['kv_reduction']:.1f} %, decode throughput x{c['decode_speedup']:.2f}, "
            f"total throughput x{c['total_speedup']:.2f}, peak RSS x{c['peak_rss_ratio']:.2f}; greedy tokens equal "
            f"to the DynamicCache run at {100 * h['token_agreement']:.1f} % of positions.\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1024+64, batch 4, 2 repeats")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--gen-len", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--hh-ratio", type=float, default=0.1, help="heavy hitters (and recent) as a share of the prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default="benchmarks/results/hf_cache")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)      # child mode
    p.add_argument("--json", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.prompt_len = a.prompt_len or (1024 if a.quick else 2048)
    a.gen_len = a.gen_len or (64 if a.quick else 128)
    a.batch = a.batch or (4 if a.quick else 8)
    a.repeats = a.repeats or (2 if a.quick else 3)
    if a.gen_len < 2 or a.prompt_len < 64 or a.batch < 1 or a.repeats < 1 or not 0 < a.hh_ratio <= 0.5:
        raise SystemExit("need --gen-len >= 2, --prompt-len >= 64, --batch >= 1, --repeats >= 1, 0 < --hh-ratio <= 0.5")
    if a.case:
        Path(a.json).write_text(json.dumps(run_case(a)))
        return 0
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    shape = ["--prompt-len", str(a.prompt_len), "--gen-len", str(a.gen_len), "--batch", str(a.batch),
             "--hh-ratio", str(a.hh_ratio), "--threads", str(a.threads)] + (["--device", a.device] if a.device else [])
    runs: dict[str, list[dict]] = {c: [] for c in CASES}
    for rep, case in interleaved(CASES, a.repeats):
        tag = f"{case}_r{rep}"
        js = out / "logs" / f"{tag}.json"
        try:
            r = run_json(["-m", "benchmarks.hf_cache", "--case", case, "--json", str(js), *shape], js,
                         env=bench_env(a.threads), log_path=out / "logs" / f"{tag}.log", timeout=a.timeout)
        except CaseFailed as e:
            print(f"FAILED {tag}: {e}", file=sys.stderr)
            return 1
        runs[case].append(r)
        print(f"  {tag}: prefill {r['prefill_s']:.2f} s, decode {r['decode_tok_s']:.2f} tok/s, "
              f"KV {r['kv_bytes'] / MIB:.1f} MiB, peak RSS {r['peak_rss_bytes'] / GIB:.3f} GiB", flush=True)
    summary = summarize(runs)
    md = markdown(summary, a)
    (out / "results.md").write_text(md)
    (out / "results.json").write_text(json.dumps({"args": vars(a), "summary": summary, "runs": runs}, indent=2))
    print("\n" + md + f"\nwrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
