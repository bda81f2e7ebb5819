"""Does `--percent auto` choose well? (issue 37) Each workload runs in a memory cgroup of its RAM budget (what a
container gives a job; the planner reads the limit, planner/cgroup.py): the auto plan through the CLI, then a
sweep of plans from the same space, each measured the same way; the auto plan should reach >= 0.9x the sweep's
best measured throughput.

    python -m benchmarks.studies.choice_check --out benchmarks/results/choice-37 [--only NAME ...] [--repeats N]

The sweep: for each weight/KV compression choice (none, int8 or int4 weights, int8 or int4 KV) the plan the search
ranks first with it, plus the largest block that fits uncompressed (FlexGen's rule of thumb): a handful of
structurally different plans, not every point of the space (a run takes minutes here). Needs root (cgroup v1 or
v2 memory controller) and a quiet machine; decode is projected from --cut-gen-len steps, as FlexGen's benchmark,
and no run warms up (each pays its first touches alike). Blocks are kept small (4-8) so a run takes minutes.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30

# name: (RAM budget GiB, block bound (--gpu-batch-size), run flags)
WORKLOADS: dict[str, tuple[float, int, list[str]]] = {
    "smol-s2048+512-2gib": (2.0, 8, ["--model", "smollm2-135m", "--prompt-len", "2048", "--gen-len", "512",
                                     "--cut-gen-len", "8"]),
    "opt1.3b-disk512+512-3gib": (3.0, 4, ["--model", "opt-1.3b", "--dummy-weights", "--prompt-len", "512",
                                          "--gen-len", "512", "--cut-gen-len", "6"]),
    "opt6.7b-s64+32-6gib": (6.0, 4, ["--model", "opt-6.7b", "--dummy-weights", "--prompt-len", "64",
                                     "--gen-len", "32", "--cut-gen-len", "4"]),
}
SWEEP_BITS = ((None, None), (8, None), (4, None), (None, 8), (None, 4))


class MemoryCgroup:
    """A memory cgroup of `limit` bytes that a child process joins before it execs (v1 or v2)."""

    def __init__(self, limit: int, name: str):
        v1 = Path("/sys/fs/cgroup/memory")
        if v1.is_dir():
            self.path, limit_file = v1 / name, "memory.limit_in_bytes"
        else:
            self.path, limit_file = Path("/sys/fs/cgroup") / name, "memory.max"
        self.path.mkdir(exist_ok=True)
        (self.path / limit_file).write_text(str(int(limit)))

    def join(self) -> None:                       # preexec_fn: runs in the child
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        for _ in range(20):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.5)


def _flags(off: dict) -> list[str]:
    out = ["--percent", *[f"{x:g}" for x in off["percent"]], "--gpu-batch-size", str(off["gpu_batch_size"]),
           "--num-gpu-batches", str(off["num_gpu_batches"])]
    if off.get("weight_bits"):
        out += ["--weight-bits", str(off["weight_bits"])]
    if off.get("kv_bits"):
        out += ["--kv-bits", str(off["kv_bits"])]
    return out


def list_candidates(name: str, dest: Path) -> None:
    """Inside the cgroup: every plan the search finds fitting, best-predicted first, as JSON."""
    from flexgen_h2o.backend import get_backend
    from flexgen_h2o.calibrate import rates
    from flexgen_h2o.config import OffloadPolicy
    from flexgen_h2o.kv import EvictionConfig
    from flexgen_h2o.models import resolve_model
    from flexgen_h2o.planner.preflight import Machine
    from flexgen_h2o.planner.search import search
    _, bound, flags = WORKLOADS[name]
    arg = {f: v for f, v in zip(flags, flags[1:] + [""]) if f.startswith("--") and not v.startswith("--")}
    cfg = resolve_model(arg["--model"])
    dummy = "--dummy-weights" in flags
    root = dest.parent / "offload"
    found = search(cfg, EvictionConfig(policy="full"), OffloadPolicy(), rates(root, model=cfg),
                   prompt_len=int(arg["--prompt-len"]), gen_len=int(arg["--gen-len"]), n_prompts=bound,
                   device_type="cpu", machine=Machine.probe(get_backend("cpu")), offload_root=root,
                   store_dir=root if dummy else None, dummy_store_bytes=2 * cfg.n_params() if dummy else 0,
                   real_weights=not dummy, keep=100000)
    dest.write_text(json.dumps([{"percent": list(c.offload.percent), "gpu_batch_size": c.offload.gpu_batch_size,
                                 "num_gpu_batches": c.offload.num_gpu_batches, "weight_bits": c.offload.weight_bits,
                                 "kv_bits": c.offload.kv_bits, "predicted_tok_s": c.prediction.total_tok_s}
                                for c in found]))


def sweep(cands: list[dict]) -> list[dict]:
    picked = []
    for wb, kb in SWEEP_BITS:
        best = next((c for c in cands if c["weight_bits"] == wb and c["kv_bits"] == kb), None)
        if best is not None:
            picked.append(best)
    plain = [c for c in cands if not c["weight_bits"] and not c["kv_bits"]]
    if plain:
        picked.append(max(plain, key=lambda c: (c["gpu_batch_size"] * c["num_gpu_batches"], c["predicted_tok_s"])))
    out = []
    for c in picked:
        if c not in out:
            out.append(c)
    return out


def run(cmd: list[str], group: MemoryCgroup, folder: Path, timeout: float) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.json"
    cmd = [sys.executable, "-m", "flexgen_h2o.run", *cmd, "--no-warmup", "--metrics-json", str(metrics),
           "--no-progress", "--offload-dir", str(folder.parent / "offload")]
    t0 = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  preexec_fn=group.join)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    row = {"command": "python -m flexgen_h2o.run " + " ".join(cmd[3:-6]), "rc": rc,
           "wall_s": time.perf_counter() - t0}
    if rc == 0 and metrics.exists():
        m = json.loads(metrics.read_text())
        chosen = [ln.split("chosen:", 1)[1].split(":")[0].strip() for ln in (folder / "log.txt").read_text()
                  .splitlines() if ln.strip().startswith("chosen:")]
        row.update(measured_tok_s=m["total_tok_s"], chosen=chosen[0] if chosen else None,
                   peak_rss_bytes=m.get("peak_rss_bytes"),
                   predicted_tok_s=(m.get("predicted") or {}).get("total_tok_s"),
                   plan={k: m.get(k) for k in ("gpu_batch_size", "num_gpu_batches")})
    return row


def _median_row(runs: list[dict]) -> dict:
    """A plan's row: its first run's fields, the median measured throughput over its runs, and every run."""
    done = [r["measured_tok_s"] for r in runs if "measured_tok_s" in r]
    row = dict(next((r for r in runs if "measured_tok_s" in r), runs[0]))
    if done:
        row["measured_tok_s"] = statistics.median(done)
    row["runs"] = runs
    return row


def study(name: str, out: Path, timeout: float, repeats: int = 1) -> dict:
    """The auto plan and the sweep's, `repeats` rounds interleaved (auto, sweep 0, 1, ...; again), each plan's
    median throughput compared."""
    budget, bound, flags = WORKLOADS[name]
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    group = MemoryCgroup(budget * GIB, f"flexgen-choice-{os.getpid()}")
    try:
        listing = folder / "candidates.json"
        subprocess.run([sys.executable, "-m", "benchmarks.studies.choice_check", "--list", name, "--json",
                        str(listing)], cwd=REPO, check=True, preexec_fn=group.join)
        cands = json.loads(listing.read_text())
        res = {"workload": name, "budget_gib": budget, "block_bound": bound, "flags": flags,
               "candidates": len(cands), "repeats": repeats, "sweep": []}
        print(f"{name}: {len(cands)} fitting plans", flush=True)
        plans = [("auto", flags + ["--percent", "auto", "--gpu-batch-size", str(bound)], None)]
        plans += [(f"sweep-{i}", flags + _flags(c), c) for i, c in enumerate(sweep(cands))]
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in plans}
        for r in range(repeats):
            for label, cmd, cand in plans:
                row = run(cmd, group, folder / label / f"run-{r}", timeout)
                if cand is not None:
                    row["candidate"] = cand
                runs[label].append(row)
                print(f"  round {r} {label}: {row}", flush=True)
            res["auto"] = _median_row(runs["auto"])
            res["sweep"] = [_median_row(runs[label]) for label, _, _ in plans[1:]]
            (folder / "result.json").write_text(json.dumps(res, indent=1) + "\n")
        best = max((r.get("measured_tok_s", 0) for r in res["sweep"]), default=0)
        auto = res["auto"].get("measured_tok_s", 0)
        res["auto_over_best"] = auto / best if best else None
        (folder / "result.json").write_text(json.dumps(res, indent=1) + "\n")
        return res
    finally:
        group.close()


def table(results: list[dict]) -> str:
    lines = ["| workload | budget | auto plan | auto tok/s (pred) | best sweep plan | best tok/s | auto / best |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        done = [s for s in r["sweep"] if "measured_tok_s" in s]
        best = max(done, key=lambda s: s["measured_tok_s"]) if done else None
        a = r["auto"]
        lines.append(f"| {r['workload']} | {r['budget_gib']:g} GiB | {a.get('chosen') or '-'} | "
                     f"{a.get('measured_tok_s', 0):.2f} ({a.get('predicted_tok_s') or 0:.2f}) | "
                     f"{' '.join(_flags(best['candidate'])) if best else '-'} | "
                     f"{best['measured_tok_s'] if best else 0:.2f} | {r.get('auto_over_best') or 0:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.choice_check", description=__doc__)
    p.add_argument("--out", type=Path)
    p.add_argument("--only", nargs="+", choices=sorted(WORKLOADS))
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every plan, interleaved (median compared)")
    p.add_argument("--list", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.list:
        list_candidates(a.list, a.json)
        return 0
    if a.out is None:
        p.error("--out is required")
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.only or WORKLOADS:
        study(name, a.out, a.timeout, a.repeats)
    # every workload studied in this folder so far (runs of separate invocations), in WORKLOADS' order
    results = [json.loads((a.out / n / "result.json").read_text()) for n in WORKLOADS
               if (a.out / n / "result.json").exists()]
    (a.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    (a.out / "results.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
