"""Decode step time against sequence length, measured so that the machine's drift cannot fake a slope.

Reading a slope off one long decode's step times (the suite's steps_<workload>.png) confounds sequence length with
wall time: on a shared VM whose speed drifts by 10 % within minutes, that drift is larger than the whole growth
of a full cache's step. Here every sequence length gets its own prefill (kept with Engine.prefill), and then
short decodes at each (length, case) run in a shuffled order, repeated: drift spreads over all lengths alike
instead of lining up with one of them. Both cases run the same batch, so only the cache differs:

- full: every token kept, the step attends prompt + t keys;
- h2o: a fixed budget (default 204 heavy + 204 recent + 1, regime (a)'s 20 % of 2048), whatever the length.

The slope of each case is the least-squares line through all (length, median step time) points; the issue's
target is |h2o slope| <= 0.1 x the full cache's.

    python -m benchmarks.studies.step_scaling --out benchmarks/results/step_scaling
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

SLOPE_RATIO_MAX = 0.1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=13, help="sequences per decode, both cases (regime (a)'s full batch)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 1536, 2048, 2560], help="prompt lengths")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    p.add_argument("--skip", type=int, default=2, help="first steps of each call left out (warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hh-size", type=int, default=204)
    p.add_argument("--recent-size", type=int, default=204)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="order of the calls and text offsets")
    p.add_argument("--out", default="benchmarks/results/step_scaling")
    return p


def prompts_for(tokens: list[int], batch: int, length: int) -> list[list[int]]:
    """`batch` windows of real text, each `length` tokens, starting at different places of the stream."""
    stride = max(1, (len(tokens) - length) // max(1, batch))
    return [tokens[i * stride:i * stride + length] for i in range(batch)]


def slope_and_error(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope (seconds per token) through (length, seconds) points, and its standard error (nan
    with fewer than 3 points): the error says whether the run can resolve a slope as small as the target."""
    x, y = np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points], dtype=float)
    slope, icept = np.polyfit(x, y, 1)
    if len(x) < 3:
        return float(slope), float("nan")
    resid = y - (slope * x + icept)
    return float(slope), float(np.sqrt(resid @ resid / (len(x) - 2) / ((x - x.mean()) ** 2).sum()))


def summarize(calls: list[dict]) -> dict:
    cases = {}
    for case in dict.fromkeys(c["case"] for c in calls):
        mine = [c for c in calls if c["case"] == case]
        by_len = {n: sorted(c["median_step_s"] for c in mine if c["length"] == n)
                  for n in sorted({c["length"] for c in mine})}
        slope, error = slope_and_error([(c["length"], c["median_step_s"]) for c in mine])
        cases[case] = {"median_step_s": {n: float(np.median(v)) for n, v in by_len.items()},
                       "spread_s": {n: [v[0], v[-1]] for n, v in by_len.items()},
                       "slope_s_per_token": slope, "slope_stderr_s_per_token": error}
    out = {"cases": cases}
    if {"full", "h2o"} <= cases.keys():
        full, h2o = cases["full"]["slope_s_per_token"], cases["h2o"]["slope_s_per_token"]
        out["slope_ratio"] = h2o / full if full > 0 else float("nan")
        out["slope_target_met"] = bool(full > 0 and abs(out["slope_ratio"]) <= SLOPE_RATIO_MAX)
    return out


def markdown(summary: dict, a: argparse.Namespace) -> str:
    lens = sorted({n for c in summary["cases"].values() for n in c["median_step_s"]})
    lines = [f"# Decode step time against sequence length ({a.model}, batch {a.batch}, {a.repeats} repeats, "
             f"{a.steps} steps per call, shuffled order)", "",
             "| case | " + " | ".join(f"{n} tokens" for n in lens) + " | slope ± s.e. (ms per 1k tokens) |",
             "|---|" + "---|" * (len(lens) + 1)]
    for case, c in summary["cases"].items():
        cells = [f"{c['median_step_s'][n] * 1e3:.1f} ms ({c['spread_s'][n][0] * 1e3:.0f}-"
                 f"{c['spread_s'][n][1] * 1e3:.0f})" for n in lens]
        slope, err = c["slope_s_per_token"] * 1e6, c["slope_stderr_s_per_token"] * 1e6
        lines.append(f"| {case} | " + " | ".join(cells) + f" | {slope:.1f} ± {err:.1f} |")
    if "slope_ratio" in summary:
        verdict = "met" if summary["slope_target_met"] else "NOT met"
        lines += ["", f"h2o slope / full slope = {summary['slope_ratio']:.3f} "
                      f"(target |ratio| <= {SLOPE_RATIO_MAX}: {verdict})"]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for case, c in summary["cases"].items():
        lens = sorted(c["median_step_s"])
        med = [c["median_step_s"][n] * 1e3 for n in lens]
        err = [[m - c["spread_s"][n][0] * 1e3 for n, m in zip(lens, med)],
               [c["spread_s"][n][1] * 1e3 - m for n, m in zip(lens, med)]]
        ax.errorbar(lens, med, yerr=err, marker="o", capsize=3,
                    label=f"{case} ({c['slope_s_per_token'] * 1e6:.1f} ms per 1k tokens)")
    ax.set_xlabel("tokens in the sequence (prompt length)")
    ax.set_ylabel("decode step, ms (bars: min-max of repeats)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    import torch
    from tqdm import tqdm

    from flexgen_h2o.config import GenerationConfig, OffloadPolicy
    from flexgen_h2o.engine import Engine
    from flexgen_h2o.eval import data
    from flexgen_h2o.kv import EvictionConfig
    from flexgen_h2o.loader import load_model
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(a.model, progress=False)
    cfg = model.config
    if max(a.lengths) + a.steps > cfg.max_seq_len:
        print(f"error: --lengths up to {max(a.lengths)} + {a.steps} steps exceed {cfg.name}'s window "
              f"({cfg.max_seq_len}); use shorter lengths", file=sys.stderr)
        return 2
    stream = data.corpus_stream(model.tokenizer, "wiki", max(a.lengths) * 2)
    rules = {"full": EvictionConfig(),
             "h2o": EvictionConfig(policy="h2o", hh_size=a.hh_size, recent_size=a.recent_size)}
    engine = Engine(cfg, model.read, offload=OffloadPolicy(gpu_batch_size=a.batch, num_gpu_batches=1),
                    locate=model.locate)
    calls: list[dict] = []
    try:
        prompts = {n: prompts_for(stream, a.batch, n) for n in a.lengths}
        kept = {n: engine.prefill(prompts[n]) for n in tqdm(a.lengths, desc="prefill per length")}
        order = [(rep, n, case) for rep in range(a.repeats) for n in a.lengths for case in rules]
        random.Random(a.seed).shuffle(order)
        gen = GenerationConfig(max_new_tokens=a.steps + 1, stop_at_eos=False)
        for rep, n, case in tqdm(order, desc="timed decodes"):
            res = engine.generate(prompts[n], gen, eviction=rules[case], prefilled=kept[n])
            steps = res.metrics["step_times_s"][a.skip:]
            calls.append({"repeat": rep, "length": n, "case": case, "median_step_s": float(np.median(steps)),
                          "step_times_s": steps})
    finally:
        engine.close()
    summary = summarize(calls)
    md = markdown(summary, a)
    (out / "results.md").write_text(md)
    plot(summary, out / "step_time_vs_length.png")
    (out / "results.json").write_text(json.dumps({"args": vars(a), "summary": summary, "calls": calls},
                                                 indent=2, default=str))
    print("\n" + md + f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'step_time_vs_length.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
