"""The chat workload (issue 35): a realistic offline batch of chat turns, answered to EOS, with continuous refill.

    python -m benchmarks.chat --out benchmarks/results/chat                  # 200 prompts, 7 systems, 2 repeats
    python -m benchmarks.suite --workload chat --out benchmarks/results/chat # the same (suite.py hands it over)
    python -m benchmarks.chat --smoke --systems ours-h2o-20 --out /tmp/chat-smoke   # 12 prompts, 32 new tokens

A few hundred real prompts (benchmarks/chat_prompts.py: questions about, summaries and continuations of news,
Wikipedia and essay passages of 40-400 words), each one user turn through SmolLM2's chat template; greedy, at
most --max-new tokens (512), stopping at EOS, so answers end at very different lengths: the case continuous
refill exists for. Every system reads the same token ids (the job's ids.json; our CLI reads the JSONL of the same
turns and templates them with the same function, flexgen_h2o.schedule.blocks.encode_prompts).

Systems (benchmarks/chat_peers.py): ours-{full,h2o-20}-{refill,norefill}, openvino-f16 and openvino-evict-20-f16
(its scheduler refills), hf (fixed batches in order). Each at its best batch under one memory budget (2 GiB peak
RSS): ours from its planner, OpenVINO from its KV blocks, hf by --batch hf=N (default 16); `--batch SYSTEM=N`
overrides any. Each run is its own process with the suite's environment (2 threads, OMP_WAIT_POLICY=PASSIVE);
runs are interleaved (A B C, A B C) over --repeats. Throughput = generated tokens (EOS counted) / the process's
wall clock, loading included; `gen tok/s` divides by the generation time the system reports instead (ours: the
prompt passes and decode steps; the peers: from the first prompt submitted to the last token). Peak RSS is the
process's VmHWM as the child reports it (the parent also records wait4's ru_maxrss).

Output under --out: job/ (in.jsonl, ids.json, prompts.json), runs/<system>_r<k>/ (the child's files and log),
results.json, results.md, answer_lengths.png.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from statistics import median  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.chat_peers import GIB, STUDY, SYSTEMS, ChatSystem, Job, collect, command, pick_batch  # noqa: E402
from benchmarks.common import REPO_ROOT, bench_env  # noqa: E402
from benchmarks.systems import select_systems  # noqa: E402

SMOKE_N, SMOKE_NEW, SMOKE_CAP = 12, 32, 4
SMOKE_SYSTEMS = [n for n, s in SYSTEMS.items() if s.kind != "openvino" and n not in STUDY]   # OpenVINO only when named


def build_job(out: Path, n: int, max_new: int) -> tuple[Job, list[dict[str, Any]]]:
    """The job's files: the CLI's JSONL, the ids every peer reads, and each prompt's metadata."""
    from benchmarks.chat_prompts import build_prompts, encode, request_line
    from flexgen_h2o.loader import ensure_store, load_model
    ensure_store("smollm2-135m", progress=False)
    loaded = load_model("smollm2-135m", progress=False)
    prompts = build_prompts(n)
    ids = encode(loaded.tokenizer, prompts)
    d = out / "job"
    d.mkdir(parents=True, exist_ok=True)
    (d / "in.jsonl").write_text("".join(json.dumps(request_line(p, max_new)) + "\n" for p in prompts))
    cfg = loaded.config
    eos = int(cfg.eos_id)
    pad = int(cfg.pad_id if cfg.pad_id is not None else eos)
    (d / "ids.json").write_text(json.dumps({"prompts": ids, "max_new_tokens": [max_new] * n, "eos_id": eos,
                                            "pad_id": pad}))
    meta = [{"id": p.id, "kind": p.kind, "source": p.source, "doc": p.doc, "words": p.words,
             "prompt_tokens": len(x)} for p, x in zip(prompts, ids)]
    (d / "prompts.json").write_text(json.dumps(meta, indent=1))
    return Job(d, d / "in.jsonl", d / "ids.json", tuple(len(x) for x in ids), max_new, eos, pad), meta


def prepare(s: ChatSystem, out: Path) -> str | None:
    """One-off work outside every timed run; the reason the system is skipped when it fails."""
    if s.kind != "openvino":
        return None
    from benchmarks.systems import openvino as ov
    why = ov.ensure_venv(log=out / "openvino_venv.log")
    if why:
        return why
    try:
        return ov.export_ir("smollm2-135m", log=out / "openvino_export.log")[1]
    except (OSError, ValueError) as e:
        return f"openvino IR export: {e}"


def run_process(python: str, args: list[str], env: dict[str, str], log: Path, timeout: float | None
                ) -> tuple[int, float, int]:
    """Run one child with its output in `log`; (exit status, wall seconds, its ru_maxrss in bytes from wait4).
    On timeout its process group is killed and the status is 124."""
    with open(log, "w") as f:
        f.write(shlex.join([python, *args]) + "\n\n")
        f.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen([python, *args], cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        killed = False
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if timeout is not None and time.perf_counter() - t0 > timeout and not killed:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
            time.sleep(0.05)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return (124 if killed else proc.returncode), wall, ru.ru_maxrss * 1024


def answer_stats(lengths: list[int], finish: list[str], max_new: int) -> dict[str, Any]:
    from benchmarks.chat_prompts import spread
    n = max(len(lengths), 1)
    return {"answer_len": spread(lengths),
            "hit_max_share": sum(k >= max_new and r != "eos" for k, r in zip(lengths, finish)) / n,
            "eos_share": sum(r == "eos" for r in finish) / n}


def one_run(s: ChatSystem, job: Job, batch: int, rule: dict[str, Any], repeat: int, a: argparse.Namespace,
            env: dict[str, str]) -> dict[str, Any]:
    run = a.out / "runs" / f"{s.name}_r{repeat}"
    run.mkdir(parents=True, exist_ok=True)
    for f in ("child.json", "metrics.json", "out.jsonl"):
        (run / f).unlink(missing_ok=True)                    # a stale file is never read back
    python, args = command(s, job, batch, run)
    rc, wall, maxrss = run_process(python, args, env, run / "log.txt", a.timeout)
    row: dict[str, Any] = {"system": s.name, "repeat": repeat, "batch": batch, "batch_rule": rule,
                           "n_prompts": len(job.prompt_lens), "prompt_tokens": sum(job.prompt_lens),
                           "max_new_tokens": job.max_new, "wall_s": wall, "rusage_maxrss_bytes": maxrss,
                           "command": shlex.join([python, *args]), "log": str(run / "log.txt")}
    try:
        if rc != 0:
            raise RuntimeError(f"exit {rc}")
        got = collect(s, run, job.max_new)
    except (RuntimeError, OSError, ValueError, KeyError) as e:
        tail = (run / "log.txt").read_text(errors="replace").strip().splitlines()[-6:]
        row.update(status="failed", reason=f"{e}: " + " | ".join(tail)[-600:])
        print(f"  {s.name:24s} r{repeat} batch {batch:>3}: FAILED ({row['reason'][:300]})", flush=True)
        return row
    lengths, finish = got.pop("lengths"), got.pop("finish")
    gen = sum(lengths)
    row.update(status="ran" if len(lengths) == len(job.prompt_lens) else "incomplete", generated_tokens=gen,
               tok_s=gen / wall, gen_s=got.get("gen_s"),
               gen_tok_s=gen / got["gen_s"] if got.get("gen_s") else None,
               peak_rss_bytes=int(got.get("peak_rss_bytes") or maxrss),
               over_budget=int(got.get("peak_rss_bytes") or maxrss) > a.budget_bytes,
               **answer_stats(lengths, finish, job.max_new), lengths=lengths, finish=finish,
               extra={k: v for k, v in got.items() if k not in ("gen_s", "peak_rss_bytes")})
    print(f"  {s.name:24s} r{repeat} batch {batch:>3}: {gen} tokens in {wall:6.1f} s = {row['tok_s']:7.2f} tok/s "
          f"(gen {row['gen_tok_s'] or float('nan'):7.2f}) | peak RSS {row['peak_rss_bytes'] / GIB:.2f} GiB | "
          f"answers median {row['answer_len'].get('median', 0):.0f}, EOS {100 * row['eos_share']:.0f} %", flush=True)
    return row


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r.get("status") == "ran"]
    if not ok:
        return {}
    out = {k: median([r[k] for r in ok]) for k in ("tok_s", "wall_s", "generated_tokens")}
    gens = [r["gen_tok_s"] for r in ok if r.get("gen_tok_s")]
    out["gen_tok_s"] = median(gens) if gens else None
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in ok)
    out["runs_tok_s"] = [r["tok_s"] for r in ok]
    for k in ("answer_len", "hit_max_share", "eos_share", "batch", "prompt_tokens", "n_prompts"):
        out[k] = ok[0][k]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chat", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--systems", nargs="+", metavar="S", help=f"names, prefixes or globs; known: {', '.join(SYSTEMS)}")
    p.add_argument("--n-prompts", type=int, help=f"prompts in the job (default 200; smoke {SMOKE_N})")
    p.add_argument("--max-new", type=int, help=f"max_new_tokens per prompt (default 512; smoke {SMOKE_NEW})")
    p.add_argument("--repeats", type=int, help="runs per system, interleaved A B C, A B C (default 2; smoke 1)")
    p.add_argument("--batch", nargs="+", default=[], metavar="SYSTEM=N", help="a system's batch, no sizing rule")
    p.add_argument("--max-batch", type=int, help=f"cap of the sizing rules (default 128; smoke {SMOKE_CAP})")
    p.add_argument("--budget-gib", type=float, default=2.0, help="peak-RSS budget every system is sized for")
    p.add_argument("--smoke", action="store_true", help=f"{SMOKE_N} prompts, {SMOKE_NEW} new tokens, batches <= "
                   f"{SMOKE_CAP}, 1 repeat; default systems {', '.join(SMOKE_SYSTEMS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, help="seconds per run (smoke: 300)")
    p.add_argument("--machine-json", type=Path, help="the suite's measured machine (benchmarks.machine --json) "
                   "for the report's machine line; default: a cheap line (CPU model, cores, torch)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "chat")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    a.n_prompts = a.n_prompts or (SMOKE_N if a.smoke else 200)
    a.max_new = a.max_new or (SMOKE_NEW if a.smoke else 512)
    a.repeats = a.repeats or (1 if a.smoke else 2)
    a.max_batch = a.max_batch or (SMOKE_CAP if a.smoke else 128)
    a.timeout = a.timeout or (300 if a.smoke else None)
    a.budget_bytes = int(a.budget_gib * GIB)
    try:
        # an exact name is that system alone (ours-h2o-20-refill is also the prefix of its study variants)
        exact = [p for p in a.systems or [] if p in SYSTEMS]
        rest = [p for p in a.systems or [] if p not in SYSTEMS]
        names = exact if a.systems and not rest else select_systems(
            a.systems, SMOKE_SYSTEMS if a.smoke else [n for n in SYSTEMS if n not in STUDY], list(SYSTEMS))
        if exact and rest:
            names = [n for n in SYSTEMS if n in set(exact) | set(select_systems(rest, [], list(SYSTEMS)))]
        fixed = {}
        for spec in a.batch:
            name, _, b = spec.partition("=")
            if name not in names or not b.isdigit() or int(b) < 1:
                raise SystemExit(f"error: --batch {spec!r}: expected SYSTEM=N for a selected system ({', '.join(names)})")
            fixed[name] = int(b)
    except SystemExit as err:
        print(err.code, file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    env = bench_env(a.threads)
    job, meta = build_job(a.out, a.n_prompts, a.max_new)
    from benchmarks.chat_prompts import spread
    lens = spread(list(job.prompt_lens))
    print(f"chat job: {a.n_prompts} prompts, prompt tokens min {lens['min']} / median {lens['median']:.0f} / max "
          f"{lens['max']}, max_new {a.max_new}, budget {a.budget_gib:g} GiB peak RSS", flush=True)
    entries: dict[str, dict[str, Any]] = {}
    for n in names:
        s = SYSTEMS[n]
        reason = prepare(s, a.out)
        batch, rule = (0, {}) if reason else pick_batch(s, job, a.budget_bytes, fixed, a.max_batch)
        if not reason and batch < 1:
            reason = f"no batch fits the budget ({rule.get('rule')})"
        entries[n] = {"system": n, "status": "skipped" if reason else "pending", "reason": reason, "batch": batch,
                      "batch_rule": rule, "runs": []}
        print(f"  {n:24s} " + (f"skipped: {reason}" if reason else f"batch {batch} ({rule.get('rule')})"), flush=True)
    live = [n for n in names if entries[n]["status"] == "pending"]
    t0 = time.perf_counter()
    for rep in range(a.repeats):
        for n in live:
            e = entries[n]
            e["runs"].append(one_run(SYSTEMS[n], job, e["batch"], e["batch_rule"], rep, a, env))
    for n in live:
        e = entries[n]
        e["summary"] = summarize(e["runs"])
        e["status"] = "ran" if e["summary"] else "failed"
    doc = {"command": shlex.join(["python", "-m", "benchmarks.chat", *argv]),
           "date": datetime.datetime.now().isoformat(timespec="seconds"), "smoke": a.smoke, "threads": a.threads,
           "repeats": a.repeats, "budget_bytes": a.budget_bytes,
           "job": {"n_prompts": a.n_prompts, "max_new_tokens": a.max_new, "prompt_tokens": lens,
                   "kinds": {k: sum(m["kind"] == k for m in meta) for k in ("question", "summarize", "continue")},
                   "dir": str(job.dir)},
           "machine": machine(a.machine_json, a.threads), "bench_s": time.perf_counter() - t0,
           "systems": list(entries.values())}
    (a.out / "results.json").write_text(json.dumps(doc, indent=2, default=str))
    from benchmarks.chat_report import write_report
    md = write_report(doc, a.out)
    print("\n" + md)
    print(f"wrote {a.out / 'results.json'}, {a.out / 'results.md'}")
    return 0 if all(e["status"] in ("ran", "skipped") for e in entries.values()) else 1


def suite_argv(argv: list[str]) -> list[str] | None:
    """`python -m benchmarks.suite --workload chat ...` (benchmarks/suite.py hands it over): the arguments for
    main() without `--workload chat`, or None when the suite's own workloads are asked. Chat cannot share a run
    with them (other flags, other report)."""
    for i, x in enumerate(argv):
        if x.startswith("--workload="):
            values, j = [x.partition("=")[2]], i + 1
        elif x == "--workload":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("-"):
                j += 1
            values = argv[i + 1:j]
        else:
            continue
        if "chat" not in values:
            return None
        if values != ["chat"]:
            raise SystemExit("error: --workload chat runs alone (benchmarks/chat.py); name the others in another run")
        return argv[:i] + argv[j:]
    return None


def machine(path: Path | None, threads: int) -> dict[str, Any]:
    """The suite's measured machine when given (its report line), else a cheap description."""
    if path is not None:
        return json.loads(path.read_text())
    import platform

    import torch

    from flexgen_h2o.calibrate import cpu_model
    return {"cheap": True, "date": datetime.date.today().isoformat(), "host": platform.node(), "cpu": cpu_model(),
            "cpus": os.cpu_count(), "threads": threads, "torch": torch.__version__}


if __name__ == "__main__":
    sys.exit(main())
