"""H2O against the full KV cache on the same engine, each at the largest batch that fits one memory budget.

Regime (a) long context: SmolLM2-135M, prompt 2048 + gen 512, everything on the compute tier (on a CPU machine
that is RAM), one --ram-budget-gib for weights + runtime + KV + activations.
Regime (b) weights streamed from disk: an OPT-1.3B-shaped dummy model with every weight on disk (percent 0 0 ...),
512+512 and 512+1024, the page cache of the weight store dropped before every run (fsync + posix_fadvise
DONTNEED over each .npy of the store: no root needed; `fincore` checks what stayed resident), and a compute-tier
budget (--compute-budget-gib) that the staged weights, KV and activations must fit. The runs pass
--uncached-disk-weights, so every decode step reads the 2.6 GB from the disk, as it must when the model is larger
than RAM (this machine's page cache would otherwise serve every pass after the first); --page-cache turns it off.

The batch search estimates bytes from the model config (estimate_bytes below), so it is a model, not a
measurement; the report prints the measured KV bytes, compute-tier peak and peak RSS next to it.
Each case is a `python -m flexgen_h2o.run` subprocess (peak RSS per case); full and h2o alternate A B A B.
Outputs in --out: results.json, results.md, step_time_vs_seq_len.png, logs/. The step-time slope here is read
off one decode's time series, where the machine's drift lines up with the sequence length; on a shared VM
benchmarks/studies/step_scaling.py (lengths in shuffled order) is the measurement to judge flatness by.

    python -m benchmarks.h2o_throughput --repeats 2             # the full benchmark (long on a small CPU box)
    python -m benchmarks.h2o_throughput --quick                 # smoke run, ~2 min on 2 cores
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # the parent imports torch too; never spin-wait

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import (CaseFailed, bench_env, drop_page_cache, interleaved, largest_batch, median,  # noqa: E402
                               run_json)
from flexgen_h2o.config import OffloadPolicy  # noqa: E402
from flexgen_h2o.kv import EvictionConfig  # noqa: E402
from flexgen_h2o.models import ModelConfig, resolve_model  # noqa: E402
from flexgen_h2o.planner import estimate  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20
TARGETS = {"slope_ratio_max": 0.1, "a_decode_speedup_min": 3.0, "b_total_speedup_min": 3.0}


@dataclass
class Setting:
    regime: str                  # "a" (budget = RAM, weights resident) or "b" (budget = compute tier, weights on disk)
    model: str
    prompt_len: int
    gen_len: int
    budget_bytes: int
    dummy: bool
    percent: tuple[float, ...]

    @property
    def name(self) -> str:
        return f"{self.regime}:{self.model} {self.prompt_len}+{self.gen_len}"


@dataclass
class Plan:
    setting: Setting
    case: str                    # "full" or "h2o"
    slots: int                   # allocated KV slots per sequence
    gbs: int
    num_batches: int
    est_bytes: int
    search: list[dict] = field(default_factory=list)

    @property
    def batch(self) -> int:
        return self.gbs * self.num_batches


# --- memory model: the engine's own planner ---

def eviction_for(case: str, hh_ratio: float) -> EvictionConfig:
    return EvictionConfig(policy="full") if case == "full" else EvictionConfig(policy="h2o", hh_ratio=hh_ratio)


def kv_slots(case: str, prompt_len: int, gen_len: int, hh_ratio: float) -> int:
    """Slots the engine allocates per sequence, from the engine's own Budget arithmetic."""
    return eviction_for(case, hh_ratio).resolve(prompt_len, gen_len).capacity


def offload_for(s: Setting, batch: int, a: argparse.Namespace) -> OffloadPolicy:
    k = min(a.num_gpu_batches, batch)
    return OffloadPolicy.from_percent(s.percent, gpu_batch_size=-(-batch // k), num_gpu_batches=k,
                                      prefill_batch_size=a.prefill_batch_size)


def estimate_bytes(s: Setting, case: str, batch: int, a: argparse.Namespace, act_bytes: int) -> dict[str, int]:
    """What the budget must hold for `batch` sequences, from flexgen_h2o.planner.estimate (the preflight's
    numbers: weights, KV, resting activations, staged weights and KV windows, one prefill chunk's transients).
    Regime (a) counts every tier (on a CPU they are all RAM) plus the runtime overhead (interpreter, torch,
    tokenizer); regime (b) counts the compute tier, which the staged weights share with KV and activations."""
    est = estimate(resolve_model(s.model), offload_for(s, batch, a), eviction_for(case, a.hh_ratio),
                   prompt_len=s.prompt_len, gen_len=s.gen_len, n_seqs=batch, compute_dtype_bytes=act_bytes)
    tiers = ("compute", "host") if s.regime == "a" else ("compute",)
    parts = {part: sum(est.bytes[t][part] for t in tiers) for part in ("weights", "kv", "activations", "workspace")}
    parts["overhead"] = int(a.overhead_gib * GIB) if s.regime == "a" else 0
    parts["total"] = sum(parts.values())
    return parts


def search_batch(s: Setting, case: str, a: argparse.Namespace, act_bytes: int) -> Plan:
    """The largest batch whose estimate fits the budget. One GPU batch by default: on a CPU the compute tier
    is the same RAM, so splitting a block into K GPU batches saves no transfer and re-reads the staged layer K
    times (prefill runs in chunks, so the batch is bounded by the KV, not by the prompt's transients)."""
    est = {}

    def predict(batch: int) -> int:
        est[batch] = estimate_bytes(s, case, batch, a, act_bytes)
        return est[batch]["total"]

    best, seen = largest_batch(predict, s.budget_bytes, a.max_batch)
    if not best:
        raise SystemExit(f"{s.name} {case}: not even one sequence fits {s.budget_bytes / GIB:.3f} GiB "
                         f"(needs {seen[0][1] / GIB:.3f} GiB); raise the budget")
    off = offload_for(s, best, a)
    shown = [b for b, _ in seen if b in (1, 2, 4, 8, 16, 32, 64, 128) or b == best or est[b]["total"] > s.budget_bytes]
    return Plan(s, case, kv_slots(case, s.prompt_len, s.gen_len, a.hh_ratio), off.gpu_batch_size,
                off.num_gpu_batches, est[best]["total"],
                [{"batch": b, "fits": est[b]["total"] <= s.budget_bytes, "est": est[b]} for b in shown])


def print_search(cfg: ModelConfig, plan: Plan) -> None:
    s = plan.setting
    per_seq = plan.slots * cfg.kv_bytes_per_token()
    print(f"  {plan.case:4s}: {plan.slots} slots/seq = {per_seq / MIB:.2f} MiB KV/seq; budget "
          f"{s.budget_bytes / GIB:.3f} GiB")
    for r in plan.search:
        e = r["est"]
        mark = "  <= chosen" if r["batch"] == plan.batch else "" if r["fits"] else "  (over)"
        print(f"      batch {r['batch']:4d}: weights {e['weights'] / GIB:.3f} + kv {e['kv'] / GIB:.3f} + act "
              f"{e['activations'] / GIB:.3f} + work {e['workspace'] / GIB:.3f} + overhead {e['overhead'] / GIB:.3f}"
              f" = {e['total'] / GIB:.3f} GiB{mark}")


# --- running ---

def weight_store(cfg: ModelConfig) -> Path:
    from flexgen_h2o.weights import default_store_path
    return default_store_path(cfg.name + "-dummy")


def prepare_store(model: str, env: dict[str, str]) -> None:
    """Materialise the dummy store once in a throwaway process, so no timed case pays for writing it."""
    code = (f"from flexgen_h2o.loader import load_model; "
            f"load_model({model!r}, dummy_weights=True, dummy_on_disk=True)")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=Path(__file__).resolve().parent.parent)


def resident_bytes(files: list[Path]) -> int | None:
    """Page-cache residency of the files (util-linux fincore), to show the drop worked; None without fincore."""
    if not shutil.which("fincore") or not files:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                         capture_output=True, text=True)
    return sum(int(x) for x in out.stdout.split() if x.isdigit()) if out.returncode == 0 else None


def run_args(plan: Plan, a: argparse.Namespace, json_path: Path) -> list[str]:
    s = plan.setting
    args = ["-m", "flexgen_h2o.run", "--model", s.model, "--prompt-len", str(s.prompt_len),
            "--gen-len", str(s.gen_len), "--gpu-batch-size", str(plan.gbs),
            "--num-gpu-batches", str(plan.num_batches), "--percent", *[f"{x:g}" for x in s.percent],
            *(["--prefill-batch-size", str(a.prefill_batch_size)] if a.prefill_batch_size else []),
            "--offload-dir", a.offload_dir, "--metrics-json", str(json_path),
            "--no-warmup", "--no-progress"]            # a warm-up would warm the page cache regime (b) drops
    args += ["--full-cache"] if plan.case == "full" else ["--hh-ratio", str(a.hh_ratio)]
    args += ["--dummy-weights"] if s.dummy else []
    args += ["--uncached-disk-weights"] if s.regime == "b" and not a.page_cache else []
    args += ["--device", a.device] if a.device else []
    return args


def step_slope(prompt_len: int, steps: list[float], skip: int) -> float:
    """Theil-Sen slope (median of pairwise slopes) of decode step time (s) against sequence length: a few
    steps slowed by other tenants of a shared machine would tilt a least-squares fit, not the median."""
    xs = (np.arange(1, len(steps) + 1) + prompt_len)[skip:].astype(float)
    ys = np.asarray(steps, dtype=float)[skip:]
    if len(ys) < 2:
        return float("nan")
    i, j = np.triu_indices(len(ys), k=1)
    return float(np.median((ys[j] - ys[i]) / (xs[j] - xs[i])))


def summarize(plan: Plan, runs: list[dict], skip: int) -> dict:
    n = min(len(r["step_times_s"]) for r in runs)
    steps = [median([r["step_times_s"][i] for r in runs]) for i in range(n)]   # per-step median over repeats
    med = {k: median([r[k] for r in runs]) for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s",
                                                      "prefill_s", "decode_s", "peak_rss_bytes")}
    return {"setting": plan.setting.name, "case": plan.case, "batch": plan.batch, "gbs": plan.gbs,
            "num_gpu_batches": plan.num_batches, "slots_per_seq": plan.slots, "est_bytes": plan.est_bytes,
            "kv_cache_bytes": runs[0]["kv_cache_bytes"], "peak_compute_bytes": runs[0]["peak_compute_bytes"],
            **med, "step_times_s": steps, "seq_lens": [plan.setting.prompt_len + i for i in range(1, n + 1)],
            "slope_s_per_token": step_slope(plan.setting.prompt_len, steps, skip), "repeats": len(runs)}


def reusable(metrics_path: Path, args: list[str]) -> dict | None:
    """A finished case's metrics, if they can stand in for a re-run: its log shows the very same command."""
    log = metrics_path.with_suffix(".log")
    if not (metrics_path.exists() and log.exists()):
        return None
    first = log.read_text().splitlines()[:1]
    if not first or first[0].split()[1:] != [str(x) for x in args]:
        return None
    metrics = json.loads(metrics_path.read_text())
    return metrics if "step_times_s" in metrics else None


def compare(summaries: list[dict]) -> list[dict]:
    """Per setting: h2o / full ratios and the issue's targets."""
    out = []
    for name in dict.fromkeys(s["setting"] for s in summaries):
        full, h2o = (next(s for s in summaries if s["setting"] == name and s["case"] == c) for c in ("full", "h2o"))
        ratio = {k: h2o[k] / full[k] for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s")}
        slope_ratio = h2o["slope_s_per_token"] / full["slope_s_per_token"] if full["slope_s_per_token"] > 0 \
            else float("nan")
        key, need = (("decode_tok_s", TARGETS["a_decode_speedup_min"]) if name.startswith("a:")
                     else ("total_tok_s", TARGETS["b_total_speedup_min"]))
        out.append({"setting": name, **{f"speedup_{k}": v for k, v in ratio.items()}, "slope_ratio": slope_ratio,
                    "slope_target_met": bool(abs(slope_ratio) <= TARGETS["slope_ratio_max"]),
                    "speedup_target": f"{key} >= {need}x", "speedup_target_met": bool(ratio[key] >= need)})
    return out


def markdown(summaries: list[dict], comparisons: list[dict], header: str) -> str:
    lines = [header, "", "| setting | case | batch (gbs x K) | KV slots/seq | KV bytes | compute peak | peak RSS | "
             "prefill tok/s | decode tok/s | total tok/s | step slope (ms / 1k tok) |", "|" + "---|" * 11]
    for s in summaries:
        lines.append(f"| {s['setting']} | {s['case']} | {s['batch']} ({s['gbs']}x{s['num_gpu_batches']}) | "
                     f"{s['slots_per_seq']} | {s['kv_cache_bytes'] / MIB:.1f} MiB | "
                     f"{s['peak_compute_bytes'] / MIB:.1f} MiB | {s['peak_rss_bytes'] / GIB:.2f} GiB | "
                     f"{s['prefill_tok_s']:.1f} | {s['decode_tok_s']:.1f} | {s['total_tok_s']:.1f} | "
                     f"{s['slope_s_per_token'] * 1e6:.3f} |")
    lines += ["", "| setting | prefill x | decode x | total x | slope h2o/full (<= 0.1) | speedup target |",
              "|" + "---|" * 6]
    for c in comparisons:
        ok = "met" if c["speedup_target_met"] else "NOT met"
        slope = "n/a (full slope <= 0)" if c["slope_ratio"] != c["slope_ratio"] else (
            f"{c['slope_ratio']:.3f} ({'met' if c['slope_target_met'] else 'NOT met'})")
        lines.append(f"| {c['setting']} | {c['speedup_prefill_tok_s']:.2f} | {c['speedup_decode_tok_s']:.2f} | "
                     f"{c['speedup_total_tok_s']:.2f} | {slope} | {c['speedup_target']}: {ok} |")
    return "\n".join(lines) + "\n"


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")                     # headless: no display on benchmark machines
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(s["setting"] for s in summaries))
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for s in (x for x in summaries if x["setting"] == name):
            ax.plot(s["seq_lens"], np.asarray(s["step_times_s"]) * 1e3, label=f"{s['case']} (batch {s['batch']})")
        ax.set(title=name, xlabel="sequence length (tokens)", ylabel="decode step time (ms)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def settings_from_args(a: argparse.Namespace, act_bytes: int) -> list[Setting]:
    res: list[Setting] = []
    if "a" in a.regimes:
        p, g = (256, 64) if a.quick else (2048, 512)
        res.append(Setting("a", a.long_model, p, g, int(a.ram_budget_gib * GIB), False, (100, 0, 100, 0, 100, 0)))
    if "b" in a.regimes:
        for p, g in ([(128, 64)] if a.quick else [(512, g) for g in a.b_gen_lens]):
            res.append(Setting("b", a.disk_model, p, g, int(a.compute_budget_gib * GIB), True, (0, 0, 100, 0, 100, 0)))
    if a.quick:
        # quick budgets: room for about two full-cache sequences, so the search binds and the cases differ
        for s in res:
            s.budget_bytes = 10 * GIB
            one, two = (estimate_bytes(s, "full", n, a, act_bytes)["total"] for n in (1, 2))
            s.budget_bytes = two + (two - one) // 2
    return res


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.h2o_throughput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (SmolLM2 256+64, OPT-125m 128+64), ~2 min")
    p.add_argument("--regimes", nargs="+", choices=("a", "b"), default=["a", "b"])
    p.add_argument("--repeats", type=int, default=None, help="runs per case, A B A B (default 2; 1 with --quick)")
    p.add_argument("--ram-budget-gib", type=float, default=2.0,
                   help="(a): weights + runtime + KV + activations (--quick: derived, see settings_from_args)")
    p.add_argument("--compute-budget-gib", type=float, default=2.0,
                   help="(b): staged weights + KV + activations (--quick: derived)")
    p.add_argument("--overhead-gib", type=float, default=0.5, help="(a): interpreter/torch/tokenizer RSS")
    p.add_argument("--hh-ratio", type=float, default=0.1, help="H2O heavy = recent = int(r * prompt): 0.1 = 20 %%")
    p.add_argument("--long-model", default="smollm2-135m")
    p.add_argument("--disk-model", default=None, help="default opt-1.3b (opt-125m with --quick), dummy weights")
    p.add_argument("--num-gpu-batches", type=int, default=1,
                   help="K GPU batches per block (default 1: on a CPU every GPU batch re-reads the staged layer, so "
                        "one large batch is the fast shape; on a GPU, K > 1 overlaps KV loads with compute)")
    p.add_argument("--prefill-batch-size", type=int, default=None,
                   help="sequences per prefill forward, the same for both cases (default: the engine's choice)")
    p.add_argument("--page-cache", action="store_true",
                   help="(b): let the OS cache the weight files after the first pass (default: every pass reads "
                        "the disk, --uncached-disk-weights, as for a model larger than RAM)")
    p.add_argument("--b-gen-lens", type=int, nargs="+", default=[512, 1024], help="(b): 512 + each of these")
    p.add_argument("--max-batch", type=int, default=None, help="cap on the batch (default 256; 4 with --quick)")
    p.add_argument("--skip-steps", type=int, default=2, help="first decode steps left out of the slope fit")
    p.add_argument("--threads", type=int, default=2, help="OMP/MKL/torch threads, the same for every case")
    p.add_argument("--device", help="passed to flexgen_h2o.run (default: its own choice)")
    p.add_argument("--offload-dir", default=os.path.expanduser("~/flexgen_offload_dir"))
    p.add_argument("--timeout", type=float, default=None, help="seconds per case")
    p.add_argument("--out", default="benchmarks/results/h2o_throughput")
    p.add_argument("--resume", action="store_true",
                   help="reuse a case's metrics JSON already under OUT/logs (same command) instead of re-running it")
    p.add_argument("--plan-only", action="store_true", help="print the batch search and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.disk_model = a.disk_model or ("opt-125m" if a.quick else "opt-1.3b")
    a.max_batch = a.max_batch or (4 if a.quick else 256)
    a.repeats = a.repeats or (1 if a.quick else 2)
    import torch
    on_cuda = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    act_bytes = 2 if on_cuda else 4                # the engine computes in fp16 on CUDA, fp32 on CPU
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = bench_env(a.threads)
    plans: list[Plan] = []
    for s in settings_from_args(a, act_bytes):
        cfg = resolve_model(s.model)
        print(f"[{s.name}] budget {s.budget_bytes / GIB:.3f} GiB ({'RAM' if s.regime == 'a' else 'compute tier'})"
              f", act dtype {act_bytes} B, KV {cfg.kv_bytes_per_token()} B/token")
        for case in ("full", "h2o"):
            plans.append(search_batch(s, case, a, act_bytes))
            print_search(cfg, plans[-1])
    if a.plan_only:
        return 0
    for model in dict.fromkeys(p.setting.model for p in plans if p.setting.dummy):
        prepare_store(model, env)
    runs: dict[int, list[dict]] = {i: [] for i in range(len(plans))}
    for setting in dict.fromkeys(p.setting.name for p in plans):
        idx = [i for i, p in enumerate(plans) if p.setting.name == setting]
        for rep, i in interleaved(idx, a.repeats):
            plan = plans[i]
            tag = f"{setting.replace(':', '_').replace(' ', '_')}_{plan.case}_r{rep}"
            cold = {}
            metrics_path = out / "logs" / f"{tag}.json"
            m = reusable(metrics_path, run_args(plan, a, metrics_path)) if a.resume else None
            if m is not None:
                runs[i].append({**m, "repeat": rep, "reused": True})
                print(f"  {tag}: reused {metrics_path}")
                continue
            if plan.setting.dummy:
                files = sorted(weight_store(resolve_model(plan.setting.model)).rglob("*.npy"))
                n, nbytes = drop_page_cache(files)
                cold = {"dropped_files": n, "dropped_bytes": nbytes, "resident_after_drop": resident_bytes(files)}
            try:
                m = run_json(run_args(plan, a, metrics_path), metrics_path,
                             env=env, log_path=out / "logs" / f"{tag}.log", timeout=a.timeout)
            except CaseFailed as e:
                print(f"FAILED {tag}: {e}", file=sys.stderr)
                return 1
            m.update(cold, repeat=rep)
            runs[i].append(m)
            print(f"  {tag}: batch {plan.batch} prefill {m['prefill_tok_s']:.1f} decode {m['decode_tok_s']:.1f} "
                  f"total {m['total_tok_s']:.1f} tok/s, peak RSS {m['peak_rss_bytes'] / GIB:.2f} GiB"
                  + (f", resident after drop {cold['resident_after_drop']} B" if cold else ""))
    summaries = [summarize(p, runs[i], a.skip_steps) for i, p in enumerate(plans)]
    comparisons = compare(summaries)
    header = (f"# H2O vs full cache, largest batch per budget ({'quick' if a.quick else 'full'} mode, "
              f"{a.repeats} repeat(s), {a.threads} threads, hh-ratio {a.hh_ratio})")
    md = markdown(summaries, comparisons, header)
    (out / "results.md").write_text(md)
    plot(summaries, out / "step_time_vs_seq_len.png")
    with open(out / "results.json", "w") as f:
        json.dump({"args": vars(a), "targets": TARGETS, "act_bytes": act_bytes,
                   "plans": [{**asdict(p), "batch": p.batch} for p in plans], "summaries": summaries,
                   "comparisons": comparisons, "runs": {plans[i].setting.name + " " + plans[i].case: r
                                                        for i, r in runs.items()}}, f, indent=2, default=str)
    print("\n" + md)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'step_time_vs_seq_len.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
