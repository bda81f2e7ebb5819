"""Our engine: `ours-full` (every token kept: FlexGen's algorithm on our schedule) and `ours-h2o-{10,20,40}` (H2O
keeping that share of the prompt: half heavy hitters, half recent, `--hh-ratio` = share / 2). Compressed
variants put the format first: `ours-kv4-h2o-20` (--compress-cache, int4 KV), `ours-kv8-...`, `ours-w4-...`
(--compress-weight, int4 matrices), so a family prefix such as `ours-h2o` still names the plain four; so does
`ours-norefill-full` / `ours-norefill-h2o-20` (`--no-refill`: FlexGen's synchronous blocks, the chat workload's
baseline for continuous refill).

Each case is `python -m flexgen_h2o.run` in benchmark mode (FlexGen's runner on real corpus text) with
`--metrics-json`; on the chat workload, in batch mode on the job's JSONL (`--input`, `--output`). The batch search
uses the engine's own planner (`flexgen_h2o.planner.estimate`, the numbers its preflight checks) instead of a second
memory model: the largest batch whose compute + host tiers, plus the process runtime, fit the budget, in one GPU
batch. Only candidates the planner admits are probed (and the first one it refuses, when that is within the suite's
PLANNER_EDGE), from the largest down, because more sequences per weight pass is what offloading lives on.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import REPO_ROOT, largest_batch
from benchmarks.systems.base import Candidate, System, largest_fitting
from benchmarks.workloads import Workload


def prepare_store(model: str, env: dict[str, str]) -> None:
    """Write the model's dummy store once in a throwaway process, so no timed case pays for writing it."""
    code = f"from flexgen_h2o.loader import load_model; load_model({model!r}, dummy_weights=True, dummy_on_disk=True)"
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT)


def predicted_bytes(w: Workload, hh_ratio: float | None, batch: int, kv_bits: int | None = None,
                    weight_bits: int | None = None) -> int:
    """The planner's RAM estimate of one block of `batch` sequences in one GPU batch (compute + host tiers)
    plus the process runtime; for a GPU workload, its compute tier (the device's memory)."""
    from flexgen_h2o.config import OffloadPolicy
    from flexgen_h2o.kv import EvictionConfig
    from flexgen_h2o.planner import estimate
    ev = EvictionConfig(policy="full") if hh_ratio is None else EvictionConfig(policy="h2o", hh_ratio=hh_ratio)
    pol = OffloadPolicy.from_percent(w.percent, gpu_batch_size=batch, num_gpu_batches=1, kv_bits=kv_bits,
                                     weight_bits=weight_bits)
    # the engine computes in fp16 on CUDA, fp32 on a CPU
    est = estimate(w.model_config(), pol, ev, prompt_len=w.prompt_len, gen_len=w.gen_len,
                   compute_dtype_bytes=2 if w.needs_gpu else 4)
    if w.needs_gpu:             # the budget is the device: what the compute tier must hold
        return est.tier_total("compute")
    return est.tier_total("compute") + est.tier_total("host") + w.runtime_bytes


def plan_candidates(predict: Callable[[int], int], budget: int, max_batch: int) -> list[Candidate]:
    """The largest batch the planner admits and the powers of two below it, ascending, each one GPU batch (on
    a CPU splitting a block saves no transfer; the engine prefills in chunks, so the batch is bounded by the
    KV); then the first batch over budget (the search probes it if it is within its edge margin)."""
    best, seen = largest_batch(predict, budget, max_batch)
    pred = dict(seen)
    keep = sorted({b for b in pred if b & (b - 1) == 0 and b < best} | ({best} if best else set()))
    out = [Candidate(b, b, 1, pred[b]) for b in keep]
    over = [b for b, p in seen if p > budget]
    return out + [Candidate(over[0], over[0], 1, pred[over[0]])] if over else out


class Ours(System):
    kv_dtype_bytes = 2            # fp16 KV storage (plus an fp32 score and int32 position per slot)
    runs_chat = True

    def __init__(self, budget_pct: int | None, kv_bits: int | None = None, weight_bits: int | None = None,
                 refill: bool = True) -> None:
        self.budget_pct, self.kv_bits, self.weight_bits, self.refill = budget_pct, kv_bits, weight_bits, refill
        self.hh_ratio = None if budget_pct is None else budget_pct / 200
        formats = (f"kv{kv_bits}-" if kv_bits else "") + (f"w{weight_bits}-" if weight_bits else "")
        formats += "" if refill else "norefill-"
        self.name = f"ours-{formats}" + ("full" if budget_pct is None else f"h2o-{budget_pct}")
        # the engine allocates every slot up front, so RSS does not grow while decoding
        self.kv_grows = False
        self.kv_fixed_tokens = budget_pct is not None

    @property
    def kv_precision(self) -> str:
        return f"int{self.kv_bits}-g64" if self.kv_bits else "fp16"

    def skip_reason(self, w: Workload) -> str | None:
        if not self.refill and not w.is_chat:
            return "--no-refill changes nothing where every prompt generates the same length (a chat variant)"
        return None

    def search_order(self) -> str:
        return "down"

    def chat_batch(self, w: Workload) -> tuple[Candidate | None, str]:
        return largest_fitting(lambda b: predicted_bytes(w, self.hh_ratio, b, self.kv_bits, self.weight_bits), w,
                               f"planner at prompt {w.prompt_len} + gen {w.gen_len}")

    def candidates(self, w: Workload, max_batch: int) -> list[Candidate]:
        return plan_candidates(lambda b: predicted_bytes(w, self.hh_ratio, b, self.kv_bits, self.weight_bits),
                               w.budget_bytes, max_batch)

    _prepared: dict[str, str | None] = {}          # model -> failure reason, shared by the four variants

    def prepare(self, w: Workload, env: dict[str, str], out: Path) -> str | None:
        # a disk workload's dummy store is written once, outside every timed run (elsewhere weights are made in RAM)
        if w.dummy and w.cold_disk and w.model not in Ours._prepared:
            try:
                prepare_store(w.model, env)
                Ours._prepared[w.model] = None
            except subprocess.CalledProcessError as e:
                Ours._prepared[w.model] = f"writing the {w.model} dummy store failed (exit {e.returncode})"
        return Ours._prepared.get(w.model)

    def cold_files(self, w: Workload) -> list[Path]:
        from flexgen_h2o.weights import default_store_path
        return sorted(default_store_path(w.model + "-dummy").rglob("*.npy")) if w.dummy else []

    def command(self, w: Workload, c: Candidate, gen_len: int, json_path: Path, work: Path) -> list[str]:
        args = ["-m", "flexgen_h2o.run", "--model", w.model, "--gpu-batch-size", str(c.gbs),
                "--num-gpu-batches", str(c.num_batches), "--percent", *map(str, w.percent),
                "--offload-dir", str(work / "offload"), "--metrics-json", str(json_path), "--no-progress"]
        args += ["--full-cache"] if self.hh_ratio is None else ["--hh-ratio", f"{self.hh_ratio:g}"]
        args += ["--kv-bits", str(self.kv_bits)] if self.kv_bits else []
        args += ["--weight-bits", str(self.weight_bits)] if self.weight_bits else []
        if w.is_chat:           # the job's lines, each with its own max_new_tokens (written with gen_len)
            return args + ["--input", str(w.job.input_jsonl), "--output", str(self.answers(json_path)),
                           "--overwrite"] + ([] if self.refill else ["--no-refill"])
        args += ["--prompt-len", str(w.prompt_len), "--gen-len", str(gen_len)]
        args += ["--dummy-weights"] if w.dummy else []
        args += ["--no-warmup"] if w.cold_disk else []       # a warm-up would warm the page cache we dropped
        args += ["--uncached-disk-weights"] if w.uncached else []
        return args

    @staticmethod
    def answers(json_path: Path) -> Path:
        return json_path.with_suffix(".out.jsonl")

    def chat_metrics(self, raw: dict[str, Any], json_path: Path) -> dict[str, Any]:
        """Per prompt the output line's token count (EOS counted) and finish reason; the engine's own figures
        (its prompt passes and decode steps, blocks, refill joins) as extra."""
        lines = [json.loads(x) for x in self.answers(json_path).read_text().splitlines() if x.strip()]
        keep = ("prefill_s", "decode_s", "blocks", "block_size", "padding_frac", "kv_cache_bytes", "generated_tokens")
        return {"lengths": [len(x["token_ids"]) for x in lines], "finish": [x["finish_reason"] for x in lines],
                "gen_s": raw.get("total_s"), "peak_rss_bytes": raw["peak_rss_bytes"],
                "engine": {k: raw[k] for k in raw if k in keep or "refill" in k}}

    def kv_growth_bytes(self, w: Workload, batch: int, tokens: int) -> int:
        """A short probe allocates a full cache for its own gen length only; the full run allocates `tokens`
        more slots per sequence. H2O's capacity depends on the prompt alone."""
        if self.hh_ratio is not None:
            return 0
        from flexgen_h2o.config import OffloadPolicy
        from flexgen_h2o.planner.memory import kv_slot_bytes
        cfg = w.model_config()
        return batch * tokens * cfg.n_layers * kv_slot_bytes(cfg, OffloadPolicy(kv_bits=self.kv_bits).kv_format)

    def child_metrics(self, raw: dict[str, Any], c: Candidate) -> dict[str, Any]:
        block = raw["block_size"]
        return {"prefill_s": raw["prefill_s"], "decode_s": raw["decode_s"], "peak_rss_bytes": raw["peak_rss_bytes"],
                "peak_gpu_bytes": raw.get("device_peak_bytes") or None,
                "kv_bytes_per_seq": raw["kv_cache_bytes"] / block, "kv_tokens_per_seq": raw["kv_slots_per_seq"],
                "step_times_s": raw.get("step_times_s", []),
                "offloaded_weight_bytes": raw.get("weights_by_tier", {}).get("disk", 0),
                "peak_compute_bytes": raw.get("peak_compute_bytes"), "eviction": raw.get("eviction_request")}
