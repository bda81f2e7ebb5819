"""The suite's report: a markdown file (results.md) and PNG plots, built from results.json alone, so a report can
be rebuilt from an old run (`python -m benchmarks.suite_report benchmarks/results/suite`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median
from typing import Any

from benchmarks.workloads import WEIGHTS_WHERE

GIB, MIB = float(1 << 30), float(1 << 20)
# the search's verdict when its probe cap, not a slower or over-budget probe, ended an upward search
CAPPED_BEST = "best (the probe cap ended the search: --max-probes)"
THROUGHPUT_WORDS = (" Throughput: FlexGen's definitions, measured end to end (no projection). Total ceiling = "
                    "measured prefill rate x gen / prompt. Bound: per phase max(bytes that must move / bandwidth, "
                    "FLOPs / peak GEMM rate); % of bound = measured / bound.")


def _f(x: Any, nd: int = 1) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.{nd}f}" if abs(x) < 1e5 else f"{x:.3g}"


def machine_line(m: dict[str, Any]) -> str:
    dec = m["gemm_decode_GFLOPs"]
    gpu = m.get("gpu")
    link = (f"{gpu.get('name', 'GPU')}: host->device {gpu['h2d_GBps']:.1f} GB/s, device->host "
            f"{gpu['d2h_GBps']:.1f} GB/s, device copy {gpu.get('device_read_GBps', 0):.0f} GB/s, fp16 GEMM "
            f"{gpu.get('gemm_fp16_TFLOPs', 0):.0f} TFLOP/s") if gpu else "no GPU"
    cold = m.get("disk_read_cold_fraction", -1)
    isa = f" ({m['isa']})" if m.get("isa") else ""
    return (f"Machine ({m['date']}, {m['cpu']}{isa}, {m['threads']} threads, torch {m['torch']}): fp32 GEMM "
            f"{dec.get('1', 0):.1f} / {dec.get('8', 0):.1f} / {dec.get('64', 0):.1f} GFLOP/s at decode heights "
            f"1 / 8 / 64 rows, {m['gemm_prefill_GFLOPs']:.1f} GFLOP/s at prefill ({m['gemm_prefill_rows']} rows); "
            f"memory copy {m['memcpy_GBps']:.1f} GB/s (read + write), read {m['mem_read_GBps']:.1f} GB/s; disk "
            f"write {m['disk_write_GBps']:.2f} GB/s (fsync), cold read {m['disk_read_GBps']:.2f} GB/s "
            f"({100 * cold:.0f} % from the device), page-cache read {m.get('page_cache_read_GBps', 0):.2f} GB/s, "
            f"{m.get('mem_available_bytes', 0) / GIB:.1f} GiB available; {link}.")


def results_table(wl: dict[str, Any]) -> list[str]:
    head = ("| system | batch | KV | prefill tok/s | decode tok/s | total tok/s | total ceiling | peak RSS GiB | "
            "KV MiB/seq | wall s | bound tok/s (prefill / decode / total) | % of bound (prefill / decode / total) "
            "| decode limit | note |")
    lines = [head, "|" + "---|" * 14]
    for e in wl["systems"]:
        if "summary" not in e:
            lines.append(f"| {e['system']} | - | - | - | - | - | - | - | - | - | - | - | - | {e['status']}: "
                         f"{e.get('reason') or ''} |")
            continue
        s, b = e["summary"], e["roofline"]
        batch = f"{s['gbs']}x{s['num_batches']}" if s["num_batches"] > 1 else str(s["batch"])
        note = "OVER BUDGET" if e.get("over_budget") else ""
        mapped = max(r.get("extra", {}).get("rss_file_growth_bytes") or 0 for r in e["runs"])
        if mapped > 0.1 * GIB:
            note += f" file-backed pages (mapped files) added up to {mapped / GIB:.2f} GiB to its RSS while generating"
        if any(st["status"] == CAPPED_BEST for st in e.get("search", [])):
            note += " batch search capped: a larger batch was not tried"
        if e["status"] != "ran":
            note += f" {e['status']}: {e.get('reason') or ''}"
        kv = s["kv_bytes_per_seq"] / MIB if s.get("kv_bytes_per_seq") else None
        src = b.get("decode_weights_from", "-")
        limit = b["decode_limit"] + (f" (weights: {src})" if b["decode_limit"] == "io" and src != "-" else "")
        rss = _f(s["peak_rss_bytes"] / GIB, 2) + (f" (GPU {s['peak_gpu_bytes'] / GIB:.2f})"
                                                    if s.get("peak_gpu_bytes") else "")
        lines.append(
            f"| {e['system']} | {batch} | {e.get('kv_precision', '-')} | {_f(s['prefill_tok_s'])} | "
            f"{_f(s['decode_tok_s'], 2)} | "
            f"{_f(s['total_tok_s'], 2)} | {_f(b['total_ceiling_tok_s'], 2)} | {rss} | "
            f"{_f(kv, 2)} | {_f(s['wall_s'], 0)} | {_f(b['prefill_tok_s'])} / {_f(b['decode_tok_s'], 2)} / "
            f"{_f(b['total_tok_s'], 2)} | {_f(b['prefill_pct'], 0)} / {_f(b['decode_pct'], 0)} / "
            f"{_f(b['total_pct'], 0)} | {limit} | {note.strip()} |")
    return lines


def drift_table(wl: dict[str, Any]) -> list[str]:
    """Per final run, the median decode step over its first and last 10 % of steps: a cache of fixed size should
    not slow down through a run (one that grows by a token per step may)."""
    lines = ["| system | repeat | steps | first 10 % ms | last 10 % ms | last / first |", "|" + "---|" * 6]
    for e in wl["systems"]:
        for run in e["runs"]:
            st = run["step_times_s"]
            if len(st) < 10:
                continue
            n = len(st) // 10
            first, last = median(st[:n]) * 1e3, median(st[-n:]) * 1e3
            lines.append(f"| {e['system']} | {run['repeat']} | {len(st)} | {first:.0f} | {last:.0f} | "
                         f"{last / first:.2f} |")
    return lines if len(lines) > 2 else []


def search_table(wl: dict[str, Any]) -> list[str]:
    lines = ["| system | candidate (gbs x K) | planner GiB | projected peak GiB | projected total tok/s | verdict |",
             "|" + "---|" * 6]
    for e in wl["systems"]:
        for st in e["search"]:
            c = st["candidate"]
            pred = c.get("predicted_bytes")
            lines.append(f"| {e['system']} | {c['label']} | {_f(pred / GIB if pred else None, 2)} | "
                         f"{_f(st['projected_peak_bytes'] / GIB if st['projected_peak_bytes'] else None, 2)} | "
                         f"{_f(st['projected_total_tok_s'], 2)} | {st['status']} |")
    return lines


def plot_workload(wl: dict[str, Any], out: Path) -> list[str]:
    """Throughput bars per system (log scale: the rates span orders of magnitude) and decode step time against
    the current sequence length for every system that reports per-step times (ours-full and ours-h2o always)."""
    import matplotlib
    matplotlib.use("Agg")                 # no display on benchmark machines
    import matplotlib.pyplot as plt
    name = wl["workload"]["name"]
    ran = [e for e in wl["systems"] if "summary" in e]
    files: list[str] = []
    if not ran:
        return files
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(ran) * 3 + 1.5))
    ys = range(len(ran))
    for i, (key, label) in enumerate((("prefill_tok_s", "prefill"), ("decode_tok_s", "decode"),
                                      ("total_tok_s", "total"))):
        ax.barh([y * 4 + i for y in ys], [e["summary"][key] for e in ran], label=label)
    ax.set_yticks([y * 4 + 1 for y in ys], [e["system"] for e in ran])
    ax.set_xscale("log")
    ax.set_xlabel("tokens / s (measured, median over repeats)")
    ax.set_title(f"{name}: throughput at each system's best batch")
    ax.legend()
    fig.tight_layout()
    files.append(f"throughput_{name}.png")
    fig.savefig(out / files[-1], dpi=110)
    plt.close(fig)
    stepped = [e for e in ran if e["summary"]["step_times_s"]]
    if stepped:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        p = wl["workload"]["prompt_len"]
        for e in stepped:
            st = e["summary"]["step_times_s"]
            ax.plot([p + 1 + i for i in range(len(st))], [t * 1e3 for t in st],
                    label=f"{e['system']} (batch {e['summary']['batch']})")
        ax.set(xlabel="current sequence length (tokens)", ylabel="decode step time (ms)",
               title=f"{name}: decode step time vs sequence length")
        ax.legend(fontsize=8)
        fig.tight_layout()
        files.append(f"steps_{name}.png")
        fig.savefig(out / files[-1], dpi=110)
        plt.close(fig)
    return files


# the chat workload's table: each system against ours at 20 % and with the full cache, and refill's gain
CHAT_BASELINES = ("ours-h2o-20", "ours-full")
REFILL_PAIRS = (("ours-full", "ours-norefill-full"), ("ours-h2o-20", "ours-norefill-h2o-20"))


def _ratio(summ: dict[str, dict[str, Any]], a: str, b: str, key: str = "tok_s") -> str:
    x, y = summ.get(a, {}).get(key), summ.get(b, {}).get(key)
    return f"{x / y:.2f}x" if x and y else "-"


def chat_section(wl: dict[str, Any], out: Path) -> list[str]:
    """The chat workload: tok/s over each run's wall clock, the answers' lengths, refill against none."""
    w, job = wl["workload"], wl["workload"]["job"]
    summ = {e["system"]: e.get("summary") or {} for e in wl["systems"]}
    lines = [f"## {w['name']}", "",
             f"{job['n_prompts']} chat turns through {w['model']}'s chat template (prompts of {job['mean_len']} "
             f"tokens on average, {job['longest']} at most), greedy, at most {w['gen_len']} new tokens, stop at EOS; "
             f"budget {w['budget_bytes'] / GIB:.2f} GiB peak RSS per process. tok/s = generated tokens (EOS counted) "
             "/ the case process's wall clock, loading included; gen tok/s = / the generation time the system "
             "reports.", ""]
    head = ("| system | batch | generated | wall s | tok/s | gen tok/s | peak RSS GiB | answer median / p90 | EOS % | "
            "hit max % | vs " + " | vs ".join(CHAT_BASELINES) + " | note |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for e in wl["systems"]:
        s = summ[e["system"]]
        if not s:
            lines.append(f"| {e['system']} | - | {e['status']}: {e.get('reason') or ''} |")
            continue
        al = s["answer_len"]
        lines.append(f"| {e['system']} | {s['batch']} | {s['generated_tokens']:.0f} | {_f(s['wall_s'])} | "
                     f"{_f(s['tok_s'], 2)} | {_f(s['gen_tok_s'], 2)} | {s['peak_rss_bytes'] / GIB:.2f} | "
                     f"{al['median']:.0f} / {al['p90']:.0f} | {100 * s['eos_share']:.0f} | "
                     f"{100 * s['hit_max_share']:.0f} | " + " | ".join(_ratio(summ, e["system"], b)
                                                                      for b in CHAT_BASELINES)
                     + f" | {'OVER BUDGET' if e.get('over_budget') else ''} |")
    pairs = [(a, b) for a, b in REFILL_PAIRS if summ.get(a) and summ.get(b)]
    if pairs:
        lines += ["", "Refill against none (tok/s; gen tok/s): " + "; ".join(
            f"{a}: {_ratio(summ, a, b)}; {_ratio(summ, a, b, 'gen_tok_s')}" for a, b in pairs) + "."]
    lines += ["", "Batch rules: " + "; ".join(f"{e['system']}: {e['search'][0]['status']}"
                                              for e in wl["systems"] if e.get("search")) + ".", "",
              "| run | batch | tok/s | wall s | peak RSS GiB | answer min / p10 / p25 / median / p75 / p90 / max |",
              "|---|---|---|---|---|---|"]
    for e in wl["systems"]:
        for r in e["runs"]:
            al = r["answer_len"]
            lines.append(f"| {e['system']} r{r['repeat']} | {r['batch']} | {_f(r['tok_s'], 2)} | {_f(r['wall_s'])} | "
                         f"{r['peak_rss_bytes'] / GIB:.2f} | " + " / ".join(
                             f"{al[k]:.0f}" for k in ("min", "p10", "p25", "median", "p75", "p90", "max")) + " |")
    png = plot_answers(wl, out)
    return lines + ([], ["", f"![{png}]({png})"])[bool(png)] + [""]


def plot_answers(wl: dict[str, Any], out: Path) -> str | None:
    """A histogram of answer lengths per system (each system's first run), one panel each: the distributions
    often coincide and would hide each other in one."""
    series = [(e["system"], e["runs"][0]["lengths"]) for e in wl["systems"] if e["runs"]]
    if not series:
        return None
    import matplotlib
    matplotlib.use("Agg")                 # no display on benchmark machines
    import matplotlib.pyplot as plt
    name, top = wl["workload"]["name"], wl["workload"]["gen_len"]
    bins = list(range(0, top + 2, max(1, (top + 1) // 32)))
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 1.2 + 1.3 * len(series)), sharex=True, sharey=True,
                             squeeze=False)
    for ax, (system, xs) in zip(axes[:, 0], series):
        ax.hist(xs, bins=bins, color="tab:blue")
        ax.set_ylabel("prompts", fontsize=8)
        ax.set_title(system, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("answer length (generated tokens, EOS counted)")
    fig.suptitle(f"{name}: answer lengths, {wl['workload']['job']['n_prompts']} prompts, max {top} new tokens")
    fig.tight_layout()
    fig.savefig(out / f"answers_{name}.png", dpi=110)
    plt.close(fig)
    return f"answers_{name}.png"


def write_report(doc: dict[str, Any], out: Path) -> str:
    kind = "SMOKE RUN (tiny shapes; not a benchmark result)" if doc["smoke"] else "full run"
    rates = "" if all(wl["workload"].get("chat_prompts") for wl in doc["results"]) else THROUGHPUT_WORDS
    lines = [f"# Throughput suite: {kind}, {doc['date']}", "", f"Command: `{doc['command']}`", "",
             machine_line(doc["machine"]), "",
             f"{doc['repeats']} final run(s) per system, interleaved; {doc['threads']} threads and "
             "OMP_WAIT_POLICY=PASSIVE for every system; suite time "
             f"{doc['suite_s'] / 60:.1f} min.{rates}", ""]
    for wl in doc["results"]:
        w = wl["workload"]
        if w.get("chat_prompts"):
            lines += chat_section(wl, out)
            continue
        peak = "GPU memory" if w.get("budget_kind") == "gpu" else "RSS"
        lines += [f"## {w['name']}", "",
                  f"{w['model']} ({'dummy' if w['dummy'] else 'real'} weights, "
                  f"{WEIGHTS_WHERE.get(w['weights'], 'weights in RAM')}), prompt {w['prompt_len']} + gen "
                  f"{w['gen_len']}, "
                  f"budget {w['budget_bytes'] / GIB:.2f} GiB peak {peak} per process.", "", *results_table(wl), "",
                  f"Batch search (probes of {w['probe_gen_len']} new tokens, projected to {w['gen_len']}; not "
                  "results):", "", *search_table(wl), ""]
        drift = drift_table(wl)
        if drift:
            lines += ["Decode step through each final run (first vs last 10 % of its steps):", "", *drift, ""]
        for f in plot_workload(wl, out):
            lines += [f"![{f}]({f})", ""]
    md = "\n".join(lines) + "\n"
    (out / "results.md").write_text(md)
    return md


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/suite")
    print(write_report(json.loads((folder / "results.json").read_text()), folder))
