"""OpenVINO GenAI's greedy answers to the RULER prompts, run by the openvino virtualenv: never imports flexgen_h2o.

    ~/.cache/flexgen_h2o/venvs/openvino/bin/python benchmarks/studies/openvino_ruler_child.py \
        --ir ~/.cache/flexgen_h2o/formats/smollm2-135m-ov-fp32 --jobs jobs.json --out tokens.json

`benchmarks/studies/openvino_ruler.py` writes the jobs file and scores what comes back. Each job is one task at one
cache setting: {"name", "prompts" (token id lists), "eviction": null or {"start_size", "recent_size", "max_cache_size",
"snapkv_window_size"}}. Every job gets its own `ContinuousBatchingPipeline` (the eviction sizes belong to the
scheduler), built as benchmarks/systems/openvino_child.py builds one: CPU, INFERENCE_NUM_THREADS from
OMP_NUM_THREADS, KV_CACHE_PRECISION and INFERENCE_PRECISION_HINT named, prefix caching and split-fuse off, and
with eviction `AggregationMode.SUM` without RoPE re-rotation. The whole KV cache is allocated up front, sized for
every prompt at full length plus one spare block each, so the scheduler never preempts (a preempted sequence
would be recomputed and lose its eviction history: the run fails instead). One prompt is prefilled per step
(max_num_batched_tokens = the longest prompt), then the job's sequences decode together.

Generation is greedy for up to --gen-len new tokens and stops at --eos, as the harness's does; the EOS token, when
generated, is returned as the last id. The output JSON holds per job the generated ids and the seconds taken, and
is rewritten after every job, so a rerun skips jobs already there with the same prompts and settings.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

BLOCK = 32                    # the CPU plugin's KV block, in tokens


def threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS", "1"))


def num_kv_blocks(prompts: list[list[int]], gen_len: int) -> int:
    """Every prompt's full length in blocks plus one spare each: room for the whole job without eviction."""
    return sum(-(-(len(p) + gen_len) // BLOCK) + 1 for p in prompts)


def scheduler(job: dict[str, Any], gen_len: int) -> Any:
    import openvino_genai as ov_genai
    prompts = job["prompts"]
    sc = ov_genai.SchedulerConfig()
    sc.num_kv_blocks = num_kv_blocks(prompts, gen_len)
    sc.cache_size = 0
    sc.max_num_seqs = len(prompts)
    sc.max_num_batched_tokens = max(len(p) for p in prompts)
    sc.enable_prefix_caching = False
    sc.dynamic_split_fuse = False
    ev = job.get("eviction")
    if ev:
        sc.use_cache_eviction = True
        sc.cache_eviction_config = ov_genai.CacheEvictionConfig(
            ev["start_size"], ev["recent_size"], ev["max_cache_size"], ov_genai.AggregationMode.SUM,
            apply_rotation=False, snapkv_window_size=ev["snapkv_window_size"])
    return sc


def gen_config(gen_len: int, eos: int) -> Any:
    import openvino_genai as ov_genai
    g = ov_genai.GenerationConfig()
    g.max_new_tokens = gen_len
    g.do_sample = False
    g.ignore_eos = False
    g.eos_token_id = eos
    g.stop_token_ids = {eos}
    return g


def properties(a: argparse.Namespace) -> dict[str, Any]:
    return {"INFERENCE_NUM_THREADS": threads(), "KV_CACHE_PRECISION": a.kv_precision,
            "INFERENCE_PRECISION_HINT": a.inference_precision}


def run_job(a: argparse.Namespace, job: dict[str, Any]) -> dict[str, Any]:
    """Greedy ids for every prompt of the job, with the steps, the seconds and the cache use along the way."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai
    prompts = job["prompts"]
    t0 = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(a.ir, scheduler(job, a.gen_len), "CPU", properties(a))
    t_load = time.perf_counter()
    cfg = gen_config(a.gen_len, a.eos)
    handles = [pipe.add_request(i, ov.Tensor(np.asarray([p], dtype=np.int64)), cfg) for i, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    steps, prefill_steps, left_out, max_usage = 0, 0, 0, 0.0
    while pipe.has_non_finished_requests():
        decoding = [i for i, t in enumerate(tokens) if t]
        running = sum(1 for i in decoding if len(tokens[i]) < a.gen_len and tokens[i][-1] != a.eos)
        pipe.step()
        steps += 1
        m = pipe.get_metrics()
        max_usage = max(max_usage, float(m.cache_usage))
        if len(decoding) == len(prompts):
            left_out += max(running - int(m.scheduled_requests), 0)     # a decode step must run every live one
        for i, h in enumerate(handles):
            if h.can_read():
                for out in h.read().values():        # the tokens new since the last read
                    tokens[i] += list(out.generated_ids)
        if len(decoding) < len(prompts):
            prefill_steps = steps
    if left_out:
        raise SystemExit(f"error: {job['name']}: {left_out} sequence-steps left unscheduled while decoding "
                         f"(preempted: the cache was too small)")
    t_end = time.perf_counter()
    return {"tokens": tokens, "steps": steps, "prefill_steps": prefill_steps, "load_s": t_load - t0,
            "run_s": t_end - t_load, "max_cache_usage_pct": max_usage,
            "num_kv_blocks": num_kv_blocks(prompts, a.gen_len), "eviction": job.get("eviction")}


def job_key(job: dict[str, Any], a: argparse.Namespace) -> str:
    """What a stored result must match to be reused: prompts, eviction and every setting of the run (a digest)."""
    what = [job["prompts"], job.get("eviction"), a.gen_len, a.eos, a.kv_precision, a.inference_precision]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def versions() -> dict[str, str]:
    import openvino
    import openvino_genai
    return {"openvino_version": openvino.get_version(), "openvino_genai_version": openvino_genai.get_version()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ir", required=True, help="folder of the exported OpenVINO IR")
    p.add_argument("--jobs", required=True, help="JSON list of jobs (module doc)")
    p.add_argument("--out", required=True, help="JSON written after every job")
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--eos", type=int, required=True, help="EOS token id: generation stops there")
    p.add_argument("--kv-precision", default="f16", choices=("u8", "f16", "f32"))
    p.add_argument("--inference-precision", default="f32", choices=("f32", "bf16", "f16"))
    a = p.parse_args()
    jobs = json.loads(Path(a.jobs).read_text())
    out_path = Path(a.out)
    done: dict[str, Any] = json.loads(out_path.read_text()).get("jobs", {}) if out_path.is_file() else {}
    out = {"kv_precision": a.kv_precision, "inference_precision": a.inference_precision, "threads": threads(),
           "gen_len": a.gen_len, "eos": a.eos, **versions(), "jobs": {}}
    for job in jobs:
        name, key = job["name"], job_key(job, a)
        if name in done and done[name].get("key") == key:
            out["jobs"][name] = done[name]
            print(f"{name}: kept from {out_path}", file=sys.stderr, flush=True)
        else:
            r = run_job(a, job)
            out["jobs"][name] = {**r, "key": key}
            print(f"{name}: {len(job['prompts'])} prompts, {r['steps']} steps, load {r['load_s']:.1f} s, "
                  f"run {r['run_s']:.1f} s, peak cache use {r['max_cache_usage_pct']:.1f} %",
                  file=sys.stderr, flush=True)
        out_path.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
