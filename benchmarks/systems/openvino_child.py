"""One OpenVINO GenAI case, run by the openvino virtualenv's interpreter: never imports flexgen_h2o or benchmarks.

    <venv>/bin/python benchmarks/systems/openvino_child.py --ir ~/.cache/flexgen_h2o/formats/smollm2-135m-ov-fp32 \
        --ids prompt_ids.json --batch 8 --gen-len 32 --num-kv-blocks 152 --json F [--evict-start 32 ...]
    ... --chat ids.json --batch 32 --num-kv-blocks 1120 --json F   # the suite's chat workload (chat())

The pipeline is `ContinuousBatchingPipeline` on the CPU with the properties INFERENCE_NUM_THREADS (from
OMP_NUM_THREADS, the suite's thread count), KV_CACHE_PRECISION always (the plugin reports u8 as its default, but
for this uncompressed fp32 IR it compiles an f16 cache unless told), and INFERENCE_PRECISION_HINT only when asked:
left out, the plugin computes in bf16 on a CPU with AVX512_BF16 or AMX (this VM's EPYC has AVX512_BF16), as any
user of OpenVINO gets; the JSON says which.

Scheduler: `num_kv_blocks` exact (the adapter sizes it from the batch), `max_num_seqs` = batch, prefix caching
off (the warm-up's prompts share their first tokens with the measured ones). Prompt tokens per step:
`max_num_batched_tokens` = batch x prompt up to TOKEN_CAP = 4096, our engine's own prefill chunk on a CPU
(flexgen_h2o.config.PREFILL_TOKENS: GEMMs that tall already run at full rate). One step for batch 8 at prompt 512;
at batch 64 the whole batch in one step (32768 tokens) peaked at 2.24 GiB of RSS, over the suite's 2 GiB budget
(0.8 GB of it KV; a 1536-wide FFN activation is 100-200 MB per tensor at that height), so larger batches prefill
in steps of whole prompts. Split-fuse is off (vLLM-style scheduling): every prompt is prefilled before any sequence
decodes, as in our engine, so the prompt pass and the decode steps are timed apart instead of interleaved.
`--max-batched-tokens` overrides the cap for experiments.

Timing: the requests are added with `add_request` and driven by `step()`, as `generate` does internally, with a
timestamp after each step and the new tokens read from every handle. prefill_s runs from before the first
request is added until the step after which every sequence has its first token (one step when the prompts fit
the cap); decode_s is the rest, and step_times_s holds each decode step. A short warm-up (every sequence, 32
prompt tokens, 2 new tokens) runs first. The run fails when a sequence generates other than gen_len tokens, or
when a decode step leaves a running sequence unscheduled (the cache was too small and it was preempted).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

# run as a script, this folder is sys.path[0], and its openvino.py (the adapter) would shadow the openvino package
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

TOKEN_CAP = 4096              # prompt tokens per step by default (module doc)
BLOCK = 32                    # the CPU plugin's KV block, in tokens
WARMUP_PROMPT, WARMUP_NEW = 32, 2


def peak_rss_bytes() -> int:
    """VmHWM, as flexgen_h2o.metrics reads it for every other system."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def properties(a: argparse.Namespace) -> dict[str, Any]:
    props: dict[str, Any] = {"INFERENCE_NUM_THREADS": int(os.environ.get("OMP_NUM_THREADS", "2"))}
    # always named: for an uncompressed (fp32) IR the plugin picks f16, not the u8 it reports as its default
    props["KV_CACHE_PRECISION"] = a.kv_precision
    if a.inference_precision:
        props["INFERENCE_PRECISION_HINT"] = a.inference_precision
    return props


def batched_tokens(batch: int, prompt_len: int, cap: int = 0) -> int:
    """Tokens one step may compute: the whole batch's prompts up to the cap, and never less than one whole prompt
    or one token per sequence (vLLM-style scheduling takes a prompt whole)."""
    return max(min(batch * prompt_len, cap or TOKEN_CAP), prompt_len, batch)


def scheduler(a: argparse.Namespace, batch: int, prompt_len: int) -> Any:
    import openvino_genai as ov_genai
    sc = ov_genai.SchedulerConfig()
    sc.num_kv_blocks = a.num_kv_blocks
    sc.cache_size = 0
    sc.max_num_seqs = max(batch, 1)
    sc.max_num_batched_tokens = batched_tokens(batch, prompt_len, a.max_batched_tokens)
    sc.enable_prefix_caching = False
    sc.dynamic_split_fuse = False
    if a.evict_max:
        sc.use_cache_eviction = True
        sc.cache_eviction_config = ov_genai.CacheEvictionConfig(
            a.evict_start, a.evict_recent, a.evict_max, getattr(ov_genai.AggregationMode, a.evict_mode),
            apply_rotation=False, snapkv_window_size=prompt_len if a.snapkv_window < 0 else a.snapkv_window)
    return sc


def gen_config(n: int) -> Any:
    import openvino_genai as ov_genai
    g = ov_genai.GenerationConfig()
    g.max_new_tokens = n
    g.ignore_eos = True           # exactly n tokens, as every system generates
    g.do_sample = False
    return g


def drive(pipe: Any, prompts: list[list[int]], n: int) -> dict[str, Any]:
    """Runs the prompts to n new tokens each, one step at a time: the start time, a timestamp after each step,
    each sequence's tokens, the step after which every sequence had its first token, and per step the running
    sequences the scheduler left out."""
    import numpy as np
    import openvino as ov
    cfg = gen_config(n)
    t0 = time.perf_counter()
    handles = [pipe.add_request(i, ov.Tensor(np.asarray([p], dtype=np.int64)), cfg) for i, p in enumerate(prompts)]
    tokens: list[list[int]] = [[] for _ in prompts]
    stamps: list[float] = []
    left_out: list[int] = []
    usage: list[float] = []
    first = None
    while pipe.has_non_finished_requests():
        running = sum(len(t) < n for t in tokens)
        pipe.step()
        stamps.append(time.perf_counter())
        m = pipe.get_metrics()
        left_out.append(running - m.scheduled_requests)
        usage.append(float(m.cache_usage))             # % of the blocks in use when the step was scheduled
        for i, h in enumerate(handles):
            if h.can_read():
                for out in h.read().values():       # the tokens new since the last read
                    tokens[i] += list(out.generated_ids)
        if first is None and all(tokens):
            first = len(stamps) - 1
    return {"t0": t0, "stamps": stamps, "tokens": tokens, "first": first, "left_out": left_out, "usage": usage}


def load(a: argparse.Namespace, batch: int, prompt_len: int) -> Any:
    import openvino_genai as ov_genai
    return ov_genai.ContinuousBatchingPipeline(a.ir, scheduler(a, batch, prompt_len), "CPU", properties(a))


def versions() -> dict[str, str]:
    import openvino
    import openvino_genai
    return {"openvino_version": openvino.get_version(), "openvino_genai_version": openvino_genai.get_version()}


def inference_precision(a: argparse.Namespace) -> str:
    if a.inference_precision:
        return a.inference_precision
    import openvino as ov
    return ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string()


def run(a: argparse.Namespace) -> dict[str, Any]:
    ids_all = json.loads(Path(a.ids).read_text())
    if len(ids_all) < a.batch:
        raise SystemExit(f"error: {a.ids} holds {len(ids_all)} prompts, batch {a.batch} asked")
    prompts = ids_all[:a.batch]
    prompt_len = len(prompts[0])
    pipe = load(a, a.batch, prompt_len)
    if a.warmup:
        drive(pipe, [p[:WARMUP_PROMPT] for p in prompts], WARMUP_NEW)
    r = drive(pipe, prompts, a.gen_len)
    bad = sorted({len(t) for t in r["tokens"] if len(t) != a.gen_len})
    if bad or r["first"] is None:
        raise SystemExit(f"error: sequences generated {bad} tokens, not {a.gen_len}")
    first, stamps = r["first"], r["stamps"]
    # prefill steps leave sequences out (prompts beyond the token cap wait); a decode step must run every one
    unscheduled = sum(max(x, 0) for x in r["left_out"][first + 1:])
    if unscheduled:
        raise SystemExit(f"error: {unscheduled} sequence-steps left unscheduled while decoding: the cache "
                         f"({a.num_kv_blocks} blocks) is too small and sequences were preempted")
    m = pipe.get_metrics()
    kv_bytes = int(m.kv_cache_size_in_bytes)
    ev = None
    if a.evict_max:
        ev = {"aggregation_mode": a.evict_mode, "start_size": a.evict_start, "recent_size": a.evict_recent,
              "max_cache_size": a.evict_max, "evictable_size": a.evict_max - a.evict_start - a.evict_recent,
              "snapkv_window_size": prompt_len if a.snapkv_window < 0 else a.snapkv_window, "apply_rotation": False,
              "max_tokens_per_seq": a.evict_max + BLOCK - 1}
    full_len = prompt_len + a.gen_len - 1              # tokens whose K and V are stored by the end
    return {"batch": a.batch, "prompt_len": prompt_len, "gen_len": a.gen_len, "prefill_s": stamps[first] - r["t0"],
            "decode_s": stamps[-1] - stamps[first],
            "step_times_s": [y - x for x, y in zip(stamps[first:], stamps[first + 1:])],
            "prefill_steps": first + 1, "steps": len(stamps), "peak_rss_bytes": peak_rss_bytes(),
            "kv_precision": a.kv_precision, "inference_precision": inference_precision(a),
            "num_kv_blocks": a.num_kv_blocks, "kv_cache_bytes": kv_bytes,
            "kv_bytes_per_token": kv_bytes / max(a.num_kv_blocks * BLOCK, 1),
            "kv_tokens_per_seq": full_len if ev is None else min(full_len, a.evict_max),
            "max_cache_usage": float(m.max_cache_usage), "eviction": ev,
            # tokens each sequence held at the last step, from the share of blocks in use (eviction's evidence)
            "kv_tokens_per_seq_last_step": r["usage"][-1] / 100 * a.num_kv_blocks * BLOCK / a.batch,
            "max_num_batched_tokens": batched_tokens(a.batch, prompt_len, a.max_batched_tokens),
            "threads": int(os.environ.get("OMP_NUM_THREADS", "2")), **versions()}


def chat(a: argparse.Namespace) -> dict[str, Any]:
    """The suite's chat workload (benchmarks/chat_job.py): every prompt of the job (token id lists of any lengths,
    each with its own max_new_tokens) added at once, so the scheduler admits up to max_num_seqs (= --batch) and
    refills a finished sequence's place from the queue; greedy, stops at EOS. No warm-up: the job's wall clock, first
    compile included, is what is compared. Per prompt: the generated ids' count (EOS counted, as our engine's
    token_ids count it) and why it ended."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai
    job = json.loads(Path(a.chat).read_text())
    prompts, max_new, eos = job["prompts"], job["max_new_tokens"], int(job["eos_id"])
    longest = max(len(p) for p in prompts)
    t_load = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(a.ir, scheduler(a, a.batch, longest), "CPU", properties(a))
    t0 = time.perf_counter()
    handles = []
    for i, (p, n) in enumerate(zip(prompts, max_new)):
        g = ov_genai.GenerationConfig()
        g.max_new_tokens, g.do_sample, g.ignore_eos = int(n), False, False
        g.eos_token_id, g.stop_token_ids = eos, {eos}
        handles.append(pipe.add_request(i, ov.Tensor(np.asarray([p], dtype=np.int64)), g))
    tokens: list[list[int]] = [[] for _ in prompts]
    reasons: list[str] = ["none"] * len(prompts)
    steps, usage, scheduled = 0, [], []
    while pipe.has_non_finished_requests():
        pipe.step()
        steps += 1
        m = pipe.get_metrics()
        usage.append(float(m.cache_usage))
        scheduled.append(int(m.scheduled_requests))
        for i, h in enumerate(handles):
            if h.can_read():
                for out in h.read().values():
                    tokens[i] += list(out.generated_ids)
                    reason = str(getattr(out, "finish_reason", "")).rsplit(".", 1)[-1].lower()
                    if reason and reason != "none":
                        reasons[i] = reason
    t1 = time.perf_counter()
    # OpenVINO reports STOP for an EOS; an EOS it left out of generated_ids is counted as our engine counts it
    finish, lengths = [], []
    for t, r, n in zip(tokens, reasons, max_new):
        hit_eos = bool(t) and t[-1] == eos or (r == "stop" and len(t) < n)
        finish.append("eos" if hit_eos else "length")
        lengths.append(len(t) + (1 if hit_eos and (not t or t[-1] != eos) else 0))
    return {"mode": "chat", "batch": a.batch, "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
            "generated_tokens": sum(lengths), "lengths": lengths, "finish": finish,
            "eos_in_ids": sum(bool(t) and t[-1] == eos for t in tokens), "load_s": t0 - t_load,
            "gen_s": t1 - t0, "steps": steps, "max_cache_usage": max(usage, default=0.0),
            "max_scheduled": max(scheduled, default=0), "num_kv_blocks": a.num_kv_blocks,
            "kv_cache_bytes": int(pipe.get_metrics().kv_cache_size_in_bytes), "kv_precision": a.kv_precision,
            "inference_precision": inference_precision(a), "peak_rss_bytes": peak_rss_bytes(),
            "max_num_batched_tokens": batched_tokens(a.batch, longest, a.max_batched_tokens),
            "threads": int(os.environ.get("OMP_NUM_THREADS", "2")), **versions()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ir", required=True, help="folder of the exported OpenVINO IR (openvino_model.xml)")
    p.add_argument("--ids", help="JSON list of prompts (token id lists of one length)")
    p.add_argument("--chat", metavar="JOB_JSON", help="the chat workload: {prompts, max_new_tokens, eos_id} (chat())")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--kv-precision", default="u8", choices=("u8", "f16", "f32"))
    p.add_argument("--inference-precision", choices=("f32", "bf16", "f16"),
                   help="INFERENCE_PRECISION_HINT (default: the plugin's, bf16 on CPUs with AVX512_BF16/AMX)")
    p.add_argument("--max-batched-tokens", type=int, default=0, help=f"tokens per step (0: {TOKEN_CAP})")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="KV blocks of the whole cache (0: from prompts)")
    p.add_argument("--evict-start", type=int, default=0)
    p.add_argument("--evict-recent", type=int, default=0)
    p.add_argument("--evict-max", type=int, default=0, help="max_cache_size; 0: no eviction (full cache)")
    p.add_argument("--snapkv-window", type=int, default=-1,
                   help="snapkv_window_size (default: the prompt length; 0: no window, every query scored)")
    p.add_argument("--evict-mode", default="SUM", choices=("SUM", "NORM_SUM"), help="AggregationMode")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    if a.chat:
        out = chat(a)
    elif a.ids:
        out = run(a)
    else:
        p.error("--ids or --chat is required")
    Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
