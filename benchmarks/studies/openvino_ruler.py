"""OpenVINO GenAI's cache eviction on the RULER prompts the accuracy harness scored: one more row of its table.

    OMP_NUM_THREADS=1 python -m benchmarks.studies.openvino_ruler    # --ruler-len 2048 --ruler-samples 10 --seed 0

The prompts are the harness's own (flexgen_h2o.eval.ruler.niah_samples with the same tasks, length, sample count
and seed, and the smollm2-135m store's tokenizer), so the token ids OpenVINO reads are the ones our engine read.
`openvino_ruler_child.py` runs under the openvino virtualenv (benchmarks/systems/openvino.py) on the IR exported
from the same weights, generating greedily for up to 128 tokens and stopping at EOS, for three settings per task:

- `full`: the whole cache, `KV_CACHE_PRECISION` f16 (our engine stores fp16 KV);
- `evict@10%`, `evict@20%`: `use_cache_eviction` with `AggregationMode.SUM` (attention summed over the steps, the
  H2O-like mode), `snapkv_window_size` = the task's longest prompt (every prompt query adds its attention, H2O's
  column sums; the default 8 would score the last 8 queries only), no RoPE re-rotation (ours keeps positions).

Compute is `INFERENCE_PRECISION_HINT` f32, as ours is (the plugin's default on this CPU would be bf16).

Budget mapping. The harness gives each task one slot count per budget: round(fraction x (longest prompt + 128)),
197/199/195 slots at 10 % and 394/399/389 at 20 % for niah_single_1/niah_multikey_2/niah_multikey_3
(`budget_slots`, the harness's own BudgetSpec). OpenVINO takes three sizes in tokens, each a whole number of its
32-token KV blocks, and evicts whole blocks (`ov_sizes`, as benchmarks/systems/openvino.py maps ours-h2o):

    start_size     = 32                        one block of sinks, the fewest it accepts (h2o keeps none)
    recent_size    = ceil32(ceil(slots / 2))   h2o's recent half
    max_cache_size = max(ceil32(slots), start_size + recent_size + 32)    the total; the evictable area >= 1 block
    197 slots: 32 + 128 recent, max 224 (64 evictable);  394 slots: 32 + 224 recent, max 416 (160 evictable)

It evicts only once a block fills, so a sequence holds up to max_cache_size + 31 tokens, and it evicts nothing
before the whole prompt is in the cache (ours evicts while the prompt passes, as H2O does).

Scoring is the harness's: the ids up to (not including) EOS decoded with our tokenizer (skip_special_tokens),
`postprocess_pred`, then `string_match_all` against the sample's answers. The JSON (default
benchmarks/results/eval-ruler/openvino.json) holds every output, and the printed table sets the OpenVINO rows
beside ruler.json's full, h2o, local and sink. The job file and the child's raw ids go to --work (a rerun reuses
the child's finished jobs).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.systems.openvino import BLOCK, ceil_block

CHILD = Path(__file__).resolve().parent / "openvino_ruler_child.py"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "eval-ruler"
TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")
OURS_POLICIES = ("h2o", "local", "sink")          # ruler.json's rows set beside OpenVINO's
START = BLOCK                                       # OpenVINO's start area: one block


def budget_slots(prompt_lens: Sequence[int], label: str, gen_len: int) -> int:
    """The slots the harness gave a block of these prompts at this budget (grid.BudgetSpec.slots_for on the
    longest prompt + the generation room)."""
    from flexgen_h2o.eval.grid import parse_budget
    return parse_budget(label).slots_for(max(prompt_lens) + gen_len)


def ov_sizes(slots: int, window: int, block: int = BLOCK) -> dict[str, int]:
    """CacheEvictionConfig sizes (tokens) for a budget of `slots` (module doc); window = snapkv_window_size."""
    start = block
    recent = ceil_block(math.ceil(slots / 2), block)
    max_cache = max(ceil_block(slots, block), start + recent + block)
    return {"slots": slots, "start_size": start, "recent_size": recent, "max_cache_size": max_cache,
            "evictable_size": max_cache - start - recent, "snapkv_window_size": window,
            "max_tokens_per_seq": max_cache + block - 1}


def make_jobs(prompts: dict[str, list[list[int]]], budgets: Sequence[str], gen_len: int) -> list[dict[str, Any]]:
    """One child job per task and setting: full first, then each budget's eviction."""
    jobs = []
    for task, ps in prompts.items():
        jobs.append({"name": f"{task}/full", "task": task, "setting": "full", "prompts": ps, "eviction": None})
        for label in budgets:
            sizes = ov_sizes(budget_slots([len(p) for p in ps], label, gen_len), max(len(p) for p in ps))
            jobs.append({"name": f"{task}/evict@{label}", "task": task, "setting": f"evict@{label}",
                         "prompts": ps, "eviction": sizes})
    return jobs


def answer_text(ids: Sequence[int], eos: int, decode: Callable[[list[int]], str]) -> str:
    """The harness's text of one generation: the ids before EOS, decoded, then postprocess_pred."""
    from flexgen_h2o.eval.ruler import postprocess_pred
    ids = list(ids)
    if ids and ids[-1] == eos:
        ids = ids[:-1]
    return postprocess_pred(decode(ids))


def score(generations: Sequence[Sequence[int]], answers: Sequence[list[str]], eos: int,
          decode: Callable[[list[int]], str]) -> tuple[list[str], list[float]]:
    """(texts, per-sample string_match_all) as run_ruler scores them."""
    from flexgen_h2o.eval.ruler import string_match_all
    texts = [answer_text(g, eos, decode) for g in generations]
    return texts, [string_match_all(t, a) for t, a in zip(texts, answers)]


def mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def ours_scores(ruler_json: Path, budgets: Sequence[str]) -> dict[str, dict[str, float]]:
    """ruler.json's scores: task -> column ("full", "h2o@10%", ...) -> score; missing records are left out."""
    records = json.loads(ruler_json.read_text())["records"]
    cols = ["full"] + [f"{p}@{b}" for p in OURS_POLICIES for b in budgets]
    return {task: {c: records[f"{task}/{c}"]["score"] for c in cols if f"{task}/{c}" in records} for task in TASKS}


def table(ov: dict[str, dict[str, float]], ours: dict[str, dict[str, float]], budgets: Sequence[str]) -> str:
    """Markdown: per task and the mean of the tasks, OpenVINO's full and eviction beside ours."""
    ov_cols = ["full"] + [f"evict@{b}" for b in budgets]
    our_cols = ["full"] + [f"{p}@{b}" for p in OURS_POLICIES for b in budgets]
    head = ["task"] + [f"ov {c.replace('evict@', '')}" for c in ov_cols] + [f"ours {c}" for c in our_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    tasks = list(ov)
    for task in tasks + ["mean"]:
        def cell(src: dict[str, dict[str, float]], c: str) -> str:
            vals = [src.get(t, {}).get(c) for t in (tasks if task == "mean" else [task])]
            return "-" if any(v is None for v in vals) else f"{mean(vals):.2f}"     # type: ignore[arg-type]
        lines.append("| " + " | ".join([task] + [cell(ov, c) for c in ov_cols] + [cell(ours, c) for c in our_cols])
                     + " |")
    return "\n".join(lines)


def run_child(work: Path, jobs: list[dict[str, Any]], gen_len: int, eos: int, kv: str, infer: str) -> dict:
    from benchmarks.systems.openvino import ir_dir, venv_python
    jobs_path, out_path = work / "jobs.json", work / "child_out.json"
    jobs_path.write_text(json.dumps([{k: j[k] for k in ("name", "prompts", "eviction")} for j in jobs]))
    cmd = [str(venv_python()), str(CHILD), "--ir", str(ir_dir("smollm2-135m")), "--jobs", str(jobs_path),
           "--out", str(out_path), "--gen-len", str(gen_len), "--eos", str(eos), "--kv-precision", kv,
           "--inference-precision", infer]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print(" ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, env=env, check=True)                  # its progress lines go to our stderr
    return json.loads(out_path.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ruler-len", type=int, default=2048)
    p.add_argument("--ruler-samples", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--budgets", default="10%,20%")
    p.add_argument("--kv-precision", default="f16", choices=("u8", "f16", "f32"))
    p.add_argument("--inference-precision", default="f32", choices=("f32", "bf16"))
    p.add_argument("--ours", type=Path, default=RESULTS / "ruler.json", help="the harness's ruler.json")
    p.add_argument("--out", type=Path, default=RESULTS / "openvino.json")
    p.add_argument("--work", type=Path, default=Path("/tmp/flexgen_h2o_openvino_ruler"),
                   help="job file and the child's raw ids (reused by a rerun)")
    a = p.parse_args(argv)
    from flexgen_h2o.eval.grid import parse_budgets
    from flexgen_h2o.eval.ruler import niah_samples, wonderwords_version
    from flexgen_h2o.loader import load_tokenizer
    from flexgen_h2o.weights import default_store_path

    t0 = time.time()
    budgets = [b.label for b in parse_budgets(a.budgets)]
    tok = load_tokenizer(default_store_path("smollm2-135m"))
    eos = int(tok.eos_token_id)
    items = {t: niah_samples(tok, t, a.ruler_len, a.ruler_samples, a.seed, a.gen_len) for t in TASKS}
    jobs = make_jobs({t: [it.prompt for it in its] for t, its in items.items()}, budgets, a.gen_len)
    a.work.mkdir(parents=True, exist_ok=True)
    child = run_child(a.work, jobs, a.gen_len, eos, a.kv_precision, a.inference_precision)

    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)       # noqa: E731  (the harness's decode)
    ours_records = json.loads(a.ours.read_text())["records"] if a.ours.is_file() else {}
    records: dict[str, Any] = {}
    ov: dict[str, dict[str, float]] = {}
    for job in jobs:
        its, raw = items[job["task"]], child["jobs"][job["name"]]
        texts, scores = score(raw["tokens"], [it.answers for it in its], eos, decode)
        ov.setdefault(job["task"], {})[job["setting"]] = mean(scores)
        rec = {"task": job["task"], "setting": job["setting"], "score": mean(scores), "scores": scores,
               "depths": [it.depth for it in its], "answers": [it.answers for it in its], "outputs": texts,
               "new_tokens": [len(g) for g in raw["tokens"]], "eviction": job["eviction"],
               "prompt_lens": [len(it.prompt) for it in its], "load_s": round(raw["load_s"], 2),
               "run_s": round(raw["run_s"], 2), "max_cache_usage_pct": raw["max_cache_usage_pct"]}
        ours_full = ours_records.get(f"{job['task']}/full")
        if job["setting"] == "full" and ours_full:      # same model, same prompts: the texts should agree
            rec["same_text_as_ours_full"] = sum(x == y for x, y in zip(texts, ours_full["outputs"]))
        records[job["name"]] = rec
    ours = ours_scores(a.ours, budgets) if a.ours.is_file() else {}
    md = table(ov, ours, budgets)
    meta = {"model": "smollm2-135m", "tasks": list(TASKS), "length": a.ruler_len, "samples": a.ruler_samples,
            "seed": a.seed, "gen_len": a.gen_len, "budgets": budgets, "eos": eos,
            "wonderwords": wonderwords_version(), "kv_precision": child["kv_precision"],
            "inference_precision": child["inference_precision"], "threads": child["threads"],
            "aggregation_mode": "SUM", "apply_rotation": False,
            "openvino_version": child["openvino_version"], "openvino_genai_version": child["openvino_genai_version"],
            "budget_mapping": "start 32; recent ceil32(ceil(slots/2)); max_cache max(ceil32(slots), start+recent+32)"
                              "; snapkv_window_size = the task's longest prompt",
            "wall_s": round(time.time() - t0, 1)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"task": "ruler", "system": "openvino", "meta": meta, "records": records,
                                 "table": md}, indent=1))
    print(md)
    for name, rec in records.items():
        if "same_text_as_ours_full" in rec:
            print(f"{name}: {rec['same_text_as_ours_full']}/{len(rec['outputs'])} outputs equal ours (full cache)")
    print(f"wrote {a.out} ({meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
