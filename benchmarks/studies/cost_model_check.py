"""The cost model against measurement (issue 37): a grid of placements run through the CLI's benchmark mode, each
run's prediction (printed and in its metrics JSON, from this machine's cached rates) beside its measured total
throughput and peak RSS.

    python -m benchmarks.studies.cost_model_check --calibrate --out benchmarks/results/cost-37 [--only NAME ...]

Target: predicted / measured total tok/s within 0.75-1.33 for every configuration, measured peak RSS <= the
predicted peak x 1.1. Configurations run one after another, the grid --repeats times over (rounds interleaved, so
the VM's drift spreads over every configuration); each row is the median round.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ALL_RAM = ["100", "0", "100", "0", "100", "0"]
SMOL = ["--model", "smollm2-135m", "--prompt-len", "256", "--gen-len", "32"]
OPT = ["--model", "opt-1.3b", "--dummy-weights", "--prompt-len", "128", "--gen-len", "16"]
H2O = ["--hh-ratio", "0.1"]

GRID: dict[str, list[str]] = {
    "smol-ram-full-b16": SMOL + ["--gpu-batch-size", "16", "--percent", *ALL_RAM],
    "smol-ram-h2o-b32": SMOL + H2O + ["--gpu-batch-size", "32", "--percent", *ALL_RAM],
    "smol-ram-full-2x8": SMOL + ["--gpu-batch-size", "8", "--num-gpu-batches", "2", "--percent", *ALL_RAM],
    "smol-wdisk-full-b16": SMOL + ["--gpu-batch-size", "16", "--percent", "0", "0", "100", "0", "100", "0"],
    "smol-kvhalfdisk-h2o-b16": SMOL + H2O + ["--gpu-batch-size", "16", "--percent", "100", "0", "50", "0", "100", "0"],
    "smol-w4-full-b16": SMOL + ["--gpu-batch-size", "16", "--percent", *ALL_RAM, "--compress-weight"],
    "smol-kv4-full-b32": SMOL + ["--gpu-batch-size", "32", "--percent", *ALL_RAM, "--compress-cache"],
    "opt-ram-full-b8": OPT + ["--gpu-batch-size", "8", "--percent", *ALL_RAM],
    "opt-whalfdisk-full-b8": OPT + ["--gpu-batch-size", "8", "--percent", "50", "0", "100", "0", "100", "0"],
    "opt-wdisk-h2o-b16": OPT + H2O + ["--gpu-batch-size", "16", "--percent", "0", "0", "100", "0", "100", "0"],
    "opt-w8-full-b8": OPT + ["--gpu-batch-size", "8", "--percent", *ALL_RAM, "--weight-bits", "8"],
    "opt-kvdisk-full-b8": OPT + ["--gpu-batch-size", "8", "--percent", "100", "0", "0", "0", "100", "0"],
}


def run_one(name: str, args: list[str], out: Path, timeout: float) -> dict:
    folder = out / "runs" / name
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.json"
    cmd = [sys.executable, "-m", "flexgen_h2o.run", *args, "--metrics-json", str(metrics), "--no-progress",
           "--offload-dir", str(folder / "offload")]
    t0 = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    row = {"name": name, "command": "python -m flexgen_h2o.run " + " ".join(args), "rc": proc.returncode,
           "wall_s": time.perf_counter() - t0}
    if proc.returncode == 0 and metrics.exists():
        m = json.loads(metrics.read_text())
        pred = m.get("predicted") or {}
        row.update(measured_tok_s=m["total_tok_s"], predicted_tok_s=pred.get("total_tok_s"),
                   measured_prefill_s=m["prefill_s"], predicted_prefill_s=pred.get("prefill_s"),
                   measured_decode_s=m["decode_s"], predicted_decode_s=pred.get("decode_s"),
                   peak_rss_bytes=m.get("peak_rss_bytes"),
                   predicted_ram_bytes=(pred.get("peak_bytes") or {}).get("RAM"),
                   limits=pred.get("limits"))
        if row["predicted_tok_s"]:
            row["ratio"] = row["predicted_tok_s"] / row["measured_tok_s"]
            row["ok_speed"] = 0.75 <= row["ratio"] <= 1.33
        if row["predicted_ram_bytes"] and row["peak_rss_bytes"]:
            row["ok_rss"] = row["peak_rss_bytes"] <= 1.1 * row["predicted_ram_bytes"]
    return row


def median_round(rounds: list[dict]) -> dict:
    """The round with the median measured throughput (a failed round counts as the slowest), with every round's
    ratio beside it."""
    ranked = sorted(rounds, key=lambda r: r.get("measured_tok_s", -1.0))
    row = dict(ranked[(len(ranked) - 1) // 2])
    row["ratios"] = [r.get("ratio") for r in rounds]
    return row


def _rounds(row: dict) -> str:
    ratios = row.get("ratios") or []
    return f" (rounds {', '.join(f'{x:.2f}' if x else '-' for x in ratios)})" if len(ratios) > 1 else ""


def table(rows: list[dict]) -> str:
    lines = ["| configuration | predicted tok/s | measured tok/s | predicted / measured | prefill s pred / meas | "
             "decode s pred / meas | peak RSS GiB meas / pred | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ratio" not in r:
            lines.append(f"| {r['name']} | - | - | - | - | - | - | failed (rc {r['rc']}) |")
            continue
        gib = 1 << 30
        rss = (f"{r['peak_rss_bytes'] / gib:.2f} / {r['predicted_ram_bytes'] / gib:.2f}"
               if r.get("predicted_ram_bytes") else "-")
        ok = "yes" if r.get("ok_speed") and r.get("ok_rss", True) else "**no**"
        lines.append(f"| {r['name']} | {r['predicted_tok_s']:.1f} | {r['measured_tok_s']:.1f} | {r['ratio']:.2f} | "
                     f"{r['predicted_prefill_s']:.1f} / {r['measured_prefill_s']:.1f} | "
                     f"{r['predicted_decode_s']:.1f} / {r['measured_decode_s']:.1f} | {rss} | {ok} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.cost_model_check", description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", nargs="+", choices=sorted(GRID), help="these configurations only")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--calibrate", action="store_true", help="measure the machine's rates again first")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the grid, interleaved (the VM drifts): each "
                   "configuration's row is its median-throughput round")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    from flexgen_h2o.calibrate import rates
    from flexgen_h2o.models import resolve_model
    root = Path(os.path.expanduser("~/flexgen_offload_dir"))
    if a.calibrate:                   # the machine's rates of now: this VM's speed drifts up to 1.6x in an hour
        rates(root, refresh=True)
    for model in sorted({GRID[n][GRID[n].index("--model") + 1] for n in a.only or GRID}):
        # each model timed itself here, before any timed run (a run would time it in its own process)
        rates(root, model=resolve_model(model))
    runs: dict[str, list[dict]] = {}
    for rep in range(a.repeats):
        for name in a.only or GRID:
            print(f"{name} (round {rep + 1}) ...", flush=True)
            row = run_one(name, GRID[name], a.out / f"round-{rep}" if a.repeats > 1 else a.out, a.timeout)
            runs.setdefault(name, []).append({**row, "round": rep})
            print(f"  {json.dumps({k: v for k, v in row.items() if k != 'command'})}", flush=True)
            (a.out / "results.json").write_text(json.dumps([r for rs in runs.values() for r in rs], indent=1) + "\n")
    rows = [median_round(rs) for rs in runs.values()]
    text = table(rows)
    (a.out / "results.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
