"""Throughput of our engine and its real peers, side by side on one machine, with the roofline beside them.

    python -m benchmarks.suite                                    # every workload, every system (hours)
    python -m benchmarks.suite --workload s2048+512 --systems ours hf kvpress-observed-20
    python -m benchmarks.suite --smoke                            # tiny shapes, a few minutes, CI
    python -m benchmarks.suite --workload chat                    # 200 chat turns answered to EOS (issue 35)

Per workload: (1) each selected system that can run here prepares once (stores, offload folders, the kvpress
virtualenv); one that cannot is kept as a skipped row with its reason. (2) A small batch search per system:
short probes (`probe_gen_len` new tokens) at candidate batch sizes, each probe's peak RSS projected to the full
length and checked against the workload's budget; ours asks its planner first and probes from the largest
admitted batch down, the peers probe upwards until over budget or slower. (3) Final runs at each system's best
batch, fully measured (nothing projected), `--repeats` times, interleaved A B C ... C B A so machine drift hits
every system alike. Every run is its own subprocess with the same environment (bench_env: OMP_WAIT_POLICY=PASSIVE,
the same thread count). (4) Medians, the roofline from `benchmarks.machine` (measured first, same day), a markdown
report, PNG plots and results.json under --out.

The chat workload (benchmarks/chat_job.py) runs through the same steps with its job written first, each
system's batch from its sizing rule instead of probes (a run is the whole job), and its own row: generated tokens
over the run's wall clock and the answers' lengths instead of FlexGen's fixed-length rates and the roofline.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.chat_job import CHAT_KEYS, chat_row, chat_summary  # noqa: E402
from benchmarks.common import REPO_ROOT, CaseFailed, bench_env, drop_page_cache, median  # noqa: E402
from benchmarks.search import SearchResult, Step, project_probe, search_batch  # noqa: E402
from benchmarks.systems import RESULT_KEYS, Candidate, System, all_systems, select_systems  # noqa: E402
from benchmarks.systems.base import parse_batches  # noqa: E402
from benchmarks.systems.gpu_check import NEEDS_GPU, cuda_available  # noqa: E402
from benchmarks.workloads import (WORKLOADS, Workload, ensure_real_store, overridden, select_workloads,  # noqa: E402
                                  with_job)

SMOKE_WORKLOADS = ["s512+128", "disk512+128"]
NO_CHAT = "no chat mode: it runs the fixed-length benchmark prompts only"


# --- running cases ---

def run_child(python: str, args: list[str], json_path: Path, env: dict[str, str], log_path: Path,
              timeout: float | None) -> tuple[dict[str, Any], float]:
    """One case in its own process; returns (its JSON, wall seconds). The JSON is removed first so a stale one
    is never read back."""
    json_path.unlink(missing_ok=True)
    cmd = [python, *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise CaseFailed(f"timeout after {timeout} s: {shlex.join(cmd)}") from e
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    log_path.write_text(shlex.join(cmd) + "\n\n" + out)
    if proc.returncode != 0 or not json_path.is_file():
        tail = "\n".join(out.strip().splitlines()[-8:])
        raise CaseFailed(f"exit {proc.returncode}: {shlex.join(cmd)}\n{tail}")
    return json.loads(json_path.read_text()), wall


def chat_case_row(s: System, w: Workload, c: Candidate, gen_len: int, raw: dict[str, Any], json_path: Path,
                  kw: dict[str, Any]) -> dict[str, Any]:
    """A chat run's row; a run that did not answer every prompt is a failed case."""
    try:
        return chat_row(s.name, w.name, w.job, gen_len, (c.batch, c.gbs, c.num_batches),
                        s.chat_metrics(raw, json_path), **kw)
    except (OSError, ValueError, KeyError) as e:
        raise CaseFailed(f"{s.name}: {e}") from e


class Runner:
    def __init__(self, a: argparse.Namespace, env: dict[str, str]) -> None:
        self.a, self.env = a, env
        self.full_probes: dict[tuple[str, str], dict] = {}    # (system, batch) -> a probe of the whole gen_len
        self.runs_dir = a.out / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)

    def case(self, s: System, w: Workload, c: Candidate, gen_len: int, *, probe: bool, repeat: int) -> dict:
        tag = f"{w.name}_{s.name}_b{c.label}_{'probe' if probe else f'r{repeat}'}"
        json_path = self.runs_dir / f"{tag}.json"
        if w.cold_disk:
            drop_page_cache(s.cold_files(w))             # every run starts with its weight files cold
        raw, wall = run_child(s.python(), s.command(w, c, gen_len, json_path, self.a.work), json_path, self.env,
                              self.runs_dir / f"{tag}.log", self.a.timeout)
        kw = {"wall_s": wall, "threads": self.a.threads, "repeat": repeat}
        row = (chat_case_row(s, w, c, gen_len, raw, json_path, kw) if w.is_chat else
               s.normalize(raw, w, c, gen_len, probe=probe, **kw))
        json_path.with_suffix(".row.json").write_text(json.dumps(row, indent=2, default=str))
        mark = "probe" if probe else f"run {repeat}"
        rates = (f"{row['generated_tokens']} tokens, {row['tok_s']:7.2f} tok/s, answers median "
                 f"{row['answer_len'].get('median', 0):.0f}" if w.is_chat else
                 f"prefill {row['prefill_tok_s']:8.1f} | decode {row['decode_tok_s']:7.2f} | total "
                 f"{row['total_tok_s']:7.2f} tok/s")
        print(f"  {s.name:22s} {mark:7s} batch {c.label:>5}: {rates} | peak RSS {row['peak_rss_bytes'] / 2**30:.2f} "
              f"GiB | {wall:.0f} s", flush=True)
        return row

    def final(self, s: System, w: Workload, c: Candidate, repeat: int) -> dict:
        """A final run. The first one reuses a probe of the same batch that already generated the whole gen_len
        (smoke mode: the same command, nothing projected), so no case runs twice."""
        reused = self.full_probes.pop((s.name, c.label), None) if repeat == 0 else None
        if reused is None:
            return self.case(s, w, c, w.gen_len, probe=False, repeat=repeat)
        print(f"  {s.name:22s} run 0   batch {c.label:>5}: its probe, which ran the whole length", flush=True)
        return {**reused, "probe": False, "extra": {**reused["extra"], "reused_probe": True}}

    def search(self, s: System, w: Workload) -> SearchResult:
        def probe(c: Candidate) -> tuple[float, int]:
            row = self.case(s, w, c, w.probe_gen_len, probe=True, repeat=0)
            if w.probe_gen_len == w.gen_len:
                self.full_probes[(s.name, c.label)] = row
            return project_probe(row, w.gen_len, s.kv_growth_bytes(w, c.batch, w.gen_len - w.probe_gen_len),
                                 w.peak_bytes(row))
        fixed = self.a.batch.get(s.name)
        if fixed is not None:                   # --batch: no search, the batch the user named
            return SearchResult(fixed, [Step(fixed, "best (fixed by --batch)")])
        if w.is_chat:                           # a run is the whole job: the system's sizing rule, no probes
            best, rule = s.chat_batch(w)
            over = Step(Candidate(1, 1), rule)
            return SearchResult(best, [Step(best, f"best ({rule})", best.predicted_bytes)] if best else [over])
        cands = s.candidates(w, w.max_batch)
        return search_batch(cands, probe, w.budget_bytes, order=s.search_order(), max_probes=self.a.max_probes)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats (rates, times), the largest peak, per-step medians for the scaling plot."""
    out = {k: median([r[k] for r in rows]) for k in ("prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s",
                                                     "total_tok_s", "wall_s")}
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rows)
    gpu = [r["peak_gpu_bytes"] for r in rows if r["peak_gpu_bytes"]]
    out["peak_gpu_bytes"] = max(gpu) if gpu else None
    n = min(len(r["step_times_s"]) for r in rows)
    out["step_times_s"] = [median([r["step_times_s"][i] for r in rows]) for i in range(n)]
    first = rows[0]
    out.update({k: first[k] for k in ("system", "workload", "batch", "gbs", "num_batches", "prompt_len", "gen_len",
                                      "kv_bytes_per_seq", "kv_grows")})
    out["kv_tokens_per_seq"] = first["extra"].get("kv_tokens_per_seq")
    out["offloaded_weight_bytes"] = first["extra"].get("offloaded_weight_bytes", 0) or 0
    out["repeats"] = len(rows)
    out["runs_total_tok_s"] = [r["total_tok_s"] for r in rows]
    return out


def roofline(machine: dict[str, Any], w: Workload, s: System, summ: dict[str, Any]) -> dict[str, Any]:
    """The run's bound (machine.bound) and the share of it achieved, per phase. KV read per decode step is the
    average over the run: constant for H2O, (end - gen/2) tokens for caches that keep every new token."""
    from benchmarks.machine import bound
    g = summ["gen_len"]
    tokens_end = summ.get("kv_tokens_per_seq") or (summ["prompt_len"] + g)
    avg_tokens = tokens_end if s.kv_fixed_tokens else max(tokens_end - g / 2, 1)
    per_seq = summ.get("kv_bytes_per_seq") or 0
    cfg = w.model_config()
    off = summ["offloaded_weight_bytes"]
    resident = s.resident_weight_bytes(cfg, off)
    b = bound(machine, cfg, batch=summ["batch"], prompt_len=summ["prompt_len"], gen_len=g,
              kv_read_bytes_per_seq=per_seq * avg_tokens / tokens_end, offloaded_weight_bytes=off,
              resident_weight_bytes=resident, kv_tokens=avg_tokens, page_cache=not w.uncached,
              host_weight_bytes=cfg.n_params() * 2 if w.weights == "host" else 0.0)
    for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s"):
        b[k.replace("tok_s", "pct")] = 100 * summ[k] / b[k] if b[k] > 0 else float("nan")
    # total can never beat the prefill rate times gen/prompt: the time to read the prompt alone
    b["total_ceiling_tok_s"] = summ["prefill_tok_s"] * g / summ["prompt_len"]
    return b


def validate_row(row: dict[str, Any]) -> list[str]:
    """Problems with a result row (smoke mode's only check: it never asserts a speed)."""
    chat = "n_prompts" in row
    bad = [f"missing {k}" for k in (CHAT_KEYS if chat else RESULT_KEYS) if k not in row]
    if chat and len(row.get("lengths", [])) != row.get("n_prompts"):
        bad.append(f"{len(row.get('lengths', []))} answers to {row.get('n_prompts')} prompts")
    for k in ("tok_s", "wall_s") if chat else ("prefill_tok_s", "decode_tok_s", "total_tok_s", "prefill_s",
                                                "decode_s", "wall_s"):
        v = row.get(k)
        if not isinstance(v, (int, float)) or not v == v or v < 0:
            bad.append(f"{k}={v!r}")
    if not isinstance(row.get("peak_rss_bytes"), int) or row["peak_rss_bytes"] <= 0:
        bad.append(f"peak_rss_bytes={row.get('peak_rss_bytes')!r}")
    return bad


def run_workload(w: Workload, names: list[str], systems: dict[str, System], runner: Runner,
                 machine: dict[str, Any]) -> dict[str, Any]:
    a = runner.a
    if w.is_chat:                           # the job's files, which every system's command names
        w = with_job(w, a.out / f"job_{w.name}")
    print(f"\n== {w.name}: {w.describe()}", flush=True)
    entries: dict[str, dict[str, Any]] = {}
    store: list[str | None] = []            # the real-weights store: converted once, when a system first needs it
    for n in names:
        s = systems[n]
        reason = ((NEEDS_GPU if w.needs_gpu and not cuda_available() else None) or
                  (NO_CHAT if w.is_chat and not s.runs_chat else None) or s.skip_reason(w))
        if not reason:
            store = store or [ensure_real_store(w)]
            reason = store[0] or s.prepare(w, runner.env, a.work)
        entries[n] = {"system": n, "status": "skipped" if reason else "pending", "reason": reason, "search": [],
                      "runs": [], "kv_precision": s.kv_precision}
        if reason:
            print(f"  {n:22s} skipped: {reason}", flush=True)
    for n, e in entries.items():
        if e["status"] != "pending":
            continue
        res = runner.search(systems[n], w)
        e["search"] = [{**asdict(st), "candidate": {**asdict(st.candidate), "label": st.candidate.label}}
                       for st in res.steps]
        e["best"] = res.best
        if res.best is None:
            e.update(status="no batch fits", reason=res.steps[0].status if res.steps else "no candidates")
    live = [n for n, e in entries.items() if e["status"] == "pending"]
    for rep in range(a.repeats):                 # A B C, then C B A: drift hits every system alike
        for n in (live if rep % 2 == 0 else live[::-1]):
            e = entries[n]
            if e["status"] != "pending":
                continue
            try:
                e["runs"].append(runner.final(systems[n], w, e["best"], rep))
            except CaseFailed as err:
                e.update(status="failed", reason=str(err).strip().splitlines()[-1][:300])
                print(f"  {n:22s} failed: {e['reason']}", flush=True)
    for n in live:
        e = entries[n]
        if e["runs"]:
            e["summary"] = chat_summary(e["runs"]) if w.is_chat else summarize(e["runs"])
            if not w.is_chat:
                e["roofline"] = roofline(machine, w, systems[n], e["summary"])
            e["over_budget"] = w.peak_bytes(e["summary"]) > w.budget_bytes
            e["status"] = "ran" if e["status"] == "pending" else e["status"]
    for e in entries.values():
        e["best"] = asdict(e["best"]) if e.get("best") else None
    return {"workload": asdict(w), "systems": list(entries.values())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--workload", nargs="+", metavar="W", help=f"default: all ({', '.join(WORKLOADS)})")
    p.add_argument("--systems", nargs="+", metavar="S", help="names, family prefixes (ours-h2o, kvpress) or globs; "
                   f"default: the workload's list. Known: {', '.join(all_systems())}")
    p.add_argument("--smoke", "--quick", action="store_true",
                   help=f"tiny shapes (64+8, batch <= 2, OPT-125M), 1 repeat; default workloads {SMOKE_WORKLOADS}")
    p.add_argument("--uncached-weights", action="store_true",
                   help="disk workloads read their weights from the disk at every step, as for a model larger "
                   "than RAM (names get -uncached; default workloads: the disk ones)")
    p.add_argument("--repeats", type=int, help="final runs per system, interleaved (default 2; smoke 1)")
    p.add_argument("--max-probes", type=int, help="search probes per system (default 6; smoke 1)")
    p.add_argument("--budget-gib", type=float, help="override every workload's RAM budget")
    p.add_argument("--model", help="override the workloads' model (a flexgen_h2o preset, e.g. opt-6.7b)")
    p.add_argument("--gen-len", type=int, help="override the workloads' generation length (chat: max new tokens)")
    p.add_argument("--chat-prompts", type=int, help="prompts in the chat job (default 200; smoke 12)")
    p.add_argument("--batch", nargs="+", default=[], metavar="SYSTEM=B",
                   help="skip a system's batch search: B sequences, or GBSxN (N GPU batches of GBS)")
    p.add_argument("--threads", type=int, default=2, help="OMP/MKL/torch threads, the same for every system")
    p.add_argument("--timeout", type=float, help="seconds per case (smoke: 600)")
    p.add_argument("--machine-json", type=Path, help="reuse constants measured earlier instead of measuring")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "suite")
    p.add_argument("--work", type=Path, help="scratch folder for offload files (default: <out>/work)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.repeats = a.repeats or (1 if a.smoke else 2)
    a.max_probes = a.max_probes or (1 if a.smoke else 6)      # smoke: the search runs, one probe per system
    a.timeout = a.timeout or (600 if a.smoke else None)
    systems = all_systems()
    try:                                          # bad names: one line and exit 2, before anything is measured
        workloads = select_workloads(a.workload, a.smoke, a.uncached_weights, SMOKE_WORKLOADS if a.smoke else None)
        plans = [(w, select_systems(a.systems, w.systems, list(systems))) for w in workloads]
        a.batch = parse_batches(a.batch)
        unknown = sorted(set(a.batch) - {n for _, names in plans for n in names})
        if unknown:
            raise SystemExit(f"error: --batch names {', '.join(unknown)}, which this run does not include; "
                             "use the systems' full names (e.g. ours-h2o-20=64)")
        if a.model:
            from flexgen_h2o.models import ModelNameError, resolve_model
            try:
                resolve_model(a.model)
            except ModelNameError as err:
                raise SystemExit(f"error: --model: {err}") from err
        if a.gen_len is not None and a.gen_len < 2:
            raise SystemExit(f"error: --gen-len {a.gen_len}: needs at least 2 tokens (a prefill and a decode step)")
        if a.model and any(w.is_chat for w, _ in plans):
            raise SystemExit("error: --model: the chat workload's turns are SmolLM2 chat-template prompts")
        if a.chat_prompts is not None and a.chat_prompts < 1:
            raise SystemExit(f"error: --chat-prompts {a.chat_prompts}: needs at least 1 prompt")
    except SystemExit as err:
        print(err.code, file=sys.stderr)
        return 2
    if a.budget_gib:
        plans = [(replace(w, budget_bytes=int(a.budget_gib * (1 << 30))), names) for w, names in plans]
    if a.model or a.gen_len is not None:
        plans = [(overridden(w, a.model, a.gen_len), names) for w, names in plans]
    if a.chat_prompts:
        plans = [(replace(w, chat_prompts=a.chat_prompts) if w.is_chat else w, names) for w, names in plans]
    a.out.mkdir(parents=True, exist_ok=True)
    a.work = a.work or a.out / "work"
    a.work.mkdir(parents=True, exist_ok=True)
    env = bench_env(a.threads)
    if a.machine_json:
        machine = json.loads(a.machine_json.read_text())
    else:
        print("measuring the machine ...", flush=True)
        mjson = a.out / "machine.json"
        run_child(sys.executable, ["-m", "benchmarks.machine", "--json", str(mjson), "--threads", str(a.threads)]
                  + (["--smoke"] if a.smoke else []), mjson, env, a.out / "machine.log", None)
        machine = json.loads(mjson.read_text())
    t0 = time.perf_counter()
    results = [run_workload(w, names, systems, Runner(a, env), machine) for w, names in plans]
    doc = {"command": shlex.join(["python", "-m", "benchmarks.suite", *(argv if argv is not None else sys.argv[1:])]),
           "date": machine.get("date"), "smoke": a.smoke, "repeats": a.repeats, "threads": a.threads,
           "suite_s": time.perf_counter() - t0, "machine": machine, "results": results}
    (a.out / "results.json").write_text(json.dumps(doc, indent=2, default=str))
    from benchmarks.suite_report import write_report
    md = write_report(doc, a.out)
    print("\n" + md)
    print(f"wrote {a.out / 'results.json'}, {a.out / 'results.md'} and plots in {a.out}")
    if a.smoke:                                   # CI: every enabled system ran and its JSON is well formed
        problems = [f"{r['workload']['name']}/{e['system']}: {e['status']} {e.get('reason') or ''}"
                    for r in results for e in r["systems"] if e["status"] not in ("ran", "skipped")]
        problems += [f"{row['workload']}/{row['system']}: {p}" for r in results for e in r["systems"]
                     for row in e["runs"] for p in validate_row(row)]
        if problems:
            print("smoke check FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        print("smoke check passed: every enabled system ran, every result row is well formed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
