"""One vLLM (CPU build) case, run by the vllm virtualenv's interpreter: never imports flexgen_h2o or benchmarks.

    <venv>/bin/python benchmarks/systems/vllm_child.py --model ~/.cache/flexgen_h2o/formats/smollm2-135m-hf \
        --ids prompt_ids.json --batch 8 --gen-len 32 --kv-cache-bytes 300000000 --json F

Engine: `LLM(dtype="float32", enforce_eager=True)`, prefix caching off (the prompts are distinct,
and a warmup must not pre-fill the timed prompts' cache), `max_num_seqs = batch` and `max_num_batched_tokens =
batch * prompt_len` (at least max_model_len), so the whole batch is admitted at once and prefilled in one engine
step, as FlexGen and every other system here prefill. Greedy: temperature 0, `ignore_eos` and `min_tokens =
max_tokens = gen_len`, so exactly gen_len tokens per sequence; no detokenization (the others return ids too).

KV cache: vLLM preallocates a pool of `kv_cache_memory_bytes` (the byte-exact form of the legacy
VLLM_CPU_KVCACHE_SPACE, which takes whole GiB; that variable is removed here so it cannot override). The parent
sizes the pool from the batch; it is zero-filled at start-up, so its pages count in RSS from the first step.

Threads: vLLM's "auto" binding on x86 reserves one core for the scheduler process and takes one logical CPU per
physical core, which would leave 1 thread on a 2-core machine. Here VLLM_CPU_OMP_THREADS_BIND lists the first
OMP_NUM_THREADS CPUs of this process's affinity (e.g. "0,1"), so the worker runs exactly that many OpenMP threads
(vLLM then sets OMP_NUM_THREADS and the CPU affinity of its worker from that list); the worker's own environment
is read back into the JSON as a check, with each process's count of busy threads (those with a fifth of its busiest
thread's CPU time or more).

--inproc (the `vllm-inproc` system): VLLM_ENABLE_V1_MULTIPROCESSING=0, the engine core and the model run in this
process. vLLM then binds no threads; torch takes OMP_NUM_THREADS as it is, like every other system's process, and
the in-process engine steps only when asked, so `LLM.generate` adds the whole batch before its first step.

Timing, from one generation of the whole batch, every request released to the scheduler at once (the engine
core is paused while they are added, then resumed: `generate_together`): RequestOutput.metrics (vLLM V1's
RequestStateStats, with log stats on) holds first_token_ts per request, an engine-core time.monotonic() stamp
(CLOCK_MONOTONIC is system-wide on Linux, so it compares with this process's clock). prefill_s = from the first
add until the last request's first token; decode_s = from then until the last output came back (so prefill +
decode is the whole generation, adding the requests and output delivery included). `prefill_steps` counts the
distinct first-token stamps: 1 when the whole batch was prefilled in one engine step. Where metrics are missing
(another vLLM version), two runs are timed instead: max_tokens=1 gives prefill_s, the full one minus it decode_s.
One short warmup runs first (the same batch, 32 tokens of other ids, 2 generated tokens). No per-step times: the
metrics hold a request's first and last token only.

Peak RSS: vLLM runs the model in other processes (here: this front-end, the V1 engine-core process and its
worker, plus multiprocessing's resource tracker). peak_rss_bytes is the sum of every process's VmHWM over the tree
(this one and all its descendants), read after the timed run while they are all alive: each term is that
process's exact peak, so the sum bounds the tree's simultaneous peak from above (pages shared between the
processes, such as libtorch's code, count in each). Two cross-checks go into the JSON: the largest simultaneous
sum of RSS, sampled every 50 ms (`peak_rss_sampled_bytes`), and each process's Rss and Pss at the end (Pss splits
shared pages between their users, so the sum of Pss is the tree's unduplicated footprint then).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

# run as a script, this folder is sys.path[0], and its vllm.py (the adapter) would shadow the vllm package (the
# spawned engine processes inherit this sys.path)
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def bind_list(threads: int) -> str:
    """The first `threads` CPUs this process may run on, as VLLM_CPU_OMP_THREADS_BIND wants them ("0,1")."""
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cpus[:max(threads, 1)])


def vm_hwm(pid: int) -> int:
    """A process's peak resident set (VmHWM), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def proc_env(pid: int, keys: tuple[str, ...]) -> dict[str, str]:
    """Some variables of a process's start-up environment (/proc/PID/environ)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    pairs = dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)
    return {k: pairs[k] for k in keys if k in pairs}


def process_tree() -> list[Any]:
    import psutil
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def rss_now(pid: int) -> int:
    """A process's resident set now, from /proc/PID/statm (a cheap read), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def rollup(pid: int) -> dict[str, int]:
    """Rss and Pss now, from /proc/PID/smaps_rollup (walks the page tables: read once, not sampled)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    out[key.lower() + "_end_bytes"] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


class TreeSampler:
    """The largest sum of RSS over this process and its descendants, sampled every `interval_s` (statm only, so
    the sampling thread costs the measured processes next to nothing)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.peak = 0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        pids: list[int] = []
        tick = 0
        while not self._stop.wait(self._interval_s):
            if tick % 20 == 0:              # the tree changes only at start-up: re-list it once a second
                pids = [p.pid for p in process_tree()]
            tick += 1
            self.peak = max(self.peak, sum(rss_now(pid) for pid in pids))

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def busy_threads(p: Any) -> int:
    """Threads of a process that did at least a fifth of its busiest thread's CPU time (its compute threads)."""
    try:
        times = [t.user_time + t.system_time for t in p.threads()]
    except Exception:  # noqa: BLE001 - a process that just exited
        return 0
    top = max(times, default=0.0)
    return sum(t >= 0.2 * top for t in times) if top > 0 else 0


def tree_report() -> tuple[int, list[dict[str, Any]]]:
    """(sum of VmHWM over the process tree, one entry per process: name, peak, threads settings)."""
    procs = []
    for p in process_tree():
        try:
            name = p.name()
            cpus = sorted(p.cpu_affinity())
        except Exception:  # noqa: BLE001 - a process that just exited
            name, cpus = "?", []
        procs.append({"pid": p.pid, "name": name, "vm_hwm_bytes": vm_hwm(p.pid), **rollup(p.pid),
                      "cpus": cpus, "busy_threads": busy_threads(p),
                      **proc_env(p.pid, ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY", "OMP_PLACES"))})
    return sum(x["vm_hwm_bytes"] for x in procs), procs


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int) -> int:
    """K and V bytes one token costs over all layers, from the HF config."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def make_llm(a: argparse.Namespace, max_model_len: int, max_seqs: int, max_batched: int) -> Any:
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind_list(a.threads)
    # 0: the engine core and the model run in this process (torch takes OMP_NUM_THREADS as it is)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if a.inproc else "1"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)     # whole GiB; it would override the byte-exact size
    from vllm import LLM
    return LLM(model=str(a.model), tokenizer=str(a.model), dtype="float32", enforce_eager=True, seed=0,
               max_model_len=max_model_len, max_num_seqs=max_seqs, max_num_batched_tokens=max_batched,
               kv_cache_memory_bytes=a.kv_cache_bytes, enable_prefix_caching=False, disable_log_stats=False)


def sampling(n: int, final_only: bool = False) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    kind = {"output_kind": RequestOutputKind.FINAL_ONLY} if final_only else {}
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False, **kind)


def generate_together(llm: Any, prompts: list[dict[str, Any]], gen_len: int, tag: str) -> tuple[list[Any], bool]:
    """All requests released to the scheduler in one go: the engine core pauses ("keep": nothing is scheduled,
    adds are queued), every request is added, then it resumes, so its first step sees the whole batch. Without
    the pause, the engine-core process starts stepping as soon as the first request arrives over its socket, and
    the batch's prefill splits over steps by chance. Falls back to `LLM.generate` where the pause is missing.
    Returns (outputs in prompt order, whether the pause held)."""
    engine = llm.llm_engine
    if not hasattr(engine.engine_core, "call_utility"):     # in-process: it steps only when asked, after the adds
        return llm.generate(prompts, sampling(gen_len), use_tqdm=False), True
    try:
        engine.engine_core.call_utility("pause_scheduler", "keep", False)
    except Exception:  # noqa: BLE001 - another vLLM without the pause: plain generate
        return llm.generate(prompts, sampling(gen_len), use_tqdm=False), False
    params = sampling(gen_len, final_only=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    engine.engine_core.call_utility("resume_scheduler")
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{tag}-{i}"] for i in range(len(prompts))], True


def timed_generate(llm: Any, prompts: list[dict[str, Any]], gen_len: int) -> tuple[float, float, Any, str]:
    """(prefill_s, decode_s, outputs, how they were timed); see the module docstring."""
    t0 = time.monotonic()
    outs, together = generate_together(llm, prompts, gen_len, "timed")
    t_end = time.monotonic()
    how = "submitted together" if together else "LLM.generate, prefill may split"
    firsts = [o.metrics.first_token_ts for o in outs if getattr(o, "metrics", None) is not None]
    if len(firsts) == len(outs) and all(f > 0 for f in firsts):
        return max(firsts) - t0, t_end - max(firsts), outs, how + ", metrics.first_token_ts"
    t1 = time.monotonic()                   # no metrics: a prefill-only call (one token each) times the prefill
    generate_together(llm, prompts, 1, "prefill-only")
    prefill = time.monotonic() - t1
    return prefill, max(t_end - t0 - prefill, 0.0), outs, how + ", two calls (max_tokens=1, full)"


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    import vllm

    ids_all = json.loads(Path(a.ids).read_text())
    if len(ids_all) < a.batch:
        raise SystemExit(f"error: {a.ids} holds {len(ids_all)} prompts, batch {a.batch} asked")
    ids = ids_all[:a.batch]
    prompt_len = len(ids[0])
    max_model_len = a.max_model_len or prompt_len + a.gen_len
    max_batched = max(a.batch * prompt_len, max_model_len)
    with TreeSampler() as sampler:
        llm = make_llm(a, max_model_len, a.batch, max_batched)
        if a.warmup:                        # other tokens than the timed prompts': nothing of theirs is cached
            generate_together(llm, [{"prompt_token_ids": x[::-1][:32]} for x in ids], 2, "warmup")
        prefill_s, decode_s, outs, how = timed_generate(llm, [{"prompt_token_ids": x} for x in ids], a.gen_len)
        peak, procs = tree_report()         # before shutdown: every process of the tree is still alive
    got = [len(o.outputs[0].token_ids) for o in outs]
    if any(n != a.gen_len for n in got):
        raise SystemExit(f"error: vLLM generated {got} tokens, {a.gen_len} each asked")
    firsts = sorted({round(o.metrics.first_token_ts, 6) for o in outs if getattr(o, "metrics", None)})
    cfg = llm.llm_engine.vllm_config
    cache_dtype = cfg.cache_config.cache_dtype
    kv_precision = str(cfg.model_config.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype
    kv_tok = kv_bytes_per_token(Path(a.model), torch.tensor([], dtype=cfg.model_config.dtype).element_size())
    tokens = prompt_len + a.gen_len - 1     # the last generated token is never written to the cache
    return {"batch": a.batch, "prompt_len": prompt_len, "gen_len": a.gen_len, "prefill_s": prefill_s,
            "decode_s": decode_s, "step_times_s": [], "timing": how, "prefill_steps": len(firsts),
            "peak_rss_bytes": peak, "peak_rss_sampled_bytes": sampler.peak,
            "pss_end_bytes": sum(x.get("pss_end_bytes", 0) for x in procs), "processes": procs,
            "kv_bytes_per_seq": tokens * kv_tok, "kv_tokens_per_seq": tokens, "kv_precision": kv_precision,
            "kv_cache_dtype": cache_dtype, "kv_pool_bytes": a.kv_cache_bytes,
            "kv_pool_blocks": cfg.cache_config.num_gpu_blocks, "block_size": cfg.cache_config.block_size,
            "max_model_len": max_model_len, "max_num_seqs": a.batch, "max_num_batched_tokens": max_batched,
            "threads": a.threads, "engine": "in-process" if a.inproc else "multiprocess",
            "omp_threads_bind": None if a.inproc else os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "vllm_version": vllm.__version__, "transformers_version": transformers.__version__,
            "torch_version": torch.__version__}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF folder (config.json, safetensors, tokenizer)")
    p.add_argument("--ids", required=True, help="JSON list of prompts (token id lists)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=0, help="0: prompt + gen")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="vLLM's preallocated KV pool")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--inproc", action="store_true", help="engine core and model in this process (no workers)")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    Path(a.json).write_text(json.dumps(run(a), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
