"""The chat workload's report (benchmarks/chat.py): results.md and answer_lengths.png from results.json alone, so
an old run's report can be rebuilt: `python -m benchmarks.chat_report benchmarks/results/chat`."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GIB = float(1 << 30)
BASELINES = ("ours-h2o-20-refill", "ours-full-refill")
PAIRS = (("ours-full-refill", "ours-full-norefill"), ("ours-h2o-20-refill", "ours-h2o-20-norefill"))


def _f(x: Any, nd: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:.{nd}f}"


def machine_text(m: dict[str, Any]) -> str:
    if not m.get("cheap"):
        from benchmarks.suite_report import machine_line
        return machine_line(m)
    return f"Machine ({m['date']}): {m['cpu']}, {m['cpus']} CPUs, {m['threads']} threads per run, torch {m['torch']}."


def ratio(summ: dict[str, dict[str, Any]], a: str, b: str, key: str = "tok_s") -> str:
    x, y = summ.get(a, {}).get(key), summ.get(b, {}).get(key)
    return f"{x / y:.2f}x" if x and y else "-"


def write_report(doc: dict[str, Any], out: Path) -> str:
    job = doc["job"]
    pt = job["prompt_tokens"]
    summ = {e["system"]: e.get("summary") or {} for e in doc["systems"]}
    lines = [f"# Chat workload ({doc['date']})", "",
             f"`{doc['command']}`", "",
             machine_text(doc["machine"]), "",
             f"{job['n_prompts']} prompts ({', '.join(f'{v} {k}' for k, v in job['kinds'].items())}), one user turn "
             f"each through SmolLM2-135M's chat template; prompt tokens min {pt['min']} / median {pt['median']:.0f} / "
             f"max {pt['max']} (mean {pt['mean']:.0f}); greedy, at most {job['max_new_tokens']} new tokens, stop at "
             f"EOS. Budget {doc['budget_bytes'] / GIB:.2f} GiB peak RSS; {doc['threads']} threads; {doc['repeats']} "
             "interleaved repeat(s), medians shown. tok/s = generated tokens (EOS counted) / the process's wall clock "
             "(loading included); gen tok/s = / the generation time the system reports.", ""]
    head = ("| system | batch | generated | wall s | tok/s | gen tok/s | peak RSS GiB | answer median / p90 | EOS % | "
            "hit max % | vs " + " | vs ".join(BASELINES) + " |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for e in doc["systems"]:
        s = summ[e["system"]]
        if not s:
            lines.append(f"| {e['system']} | {e.get('batch') or '-'} | {e['status']}: {e.get('reason') or ''} |")
            continue
        over = " (over)" if s["peak_rss_bytes"] > doc["budget_bytes"] else ""
        al = s["answer_len"]
        lines.append(f"| {e['system']} | {s['batch']} | {s['generated_tokens']:.0f} | {_f(s['wall_s'])} | "
                     f"{_f(s['tok_s'], 2)} | {_f(s['gen_tok_s'], 2)} | {s['peak_rss_bytes'] / GIB:.2f}{over} | "
                     f"{al['median']:.0f} / {al['p90']:.0f} | {100 * s['eos_share']:.0f} | "
                     f"{100 * s['hit_max_share']:.0f} | " + " | ".join(ratio(summ, e["system"], b) for b in BASELINES)
                     + " |")
    pairs = [(a, b) for a, b in PAIRS if summ.get(a) and summ.get(b)]
    if pairs:
        lines += ["", "Refill against no refill (tok/s; gen tok/s): " + "; ".join(
            f"{a.removesuffix('-refill')}: {ratio(summ, a, b)}; {ratio(summ, a, b, 'gen_tok_s')}" for a, b in pairs)
            + "."]
    lines += ["", "Batch rules: " + "; ".join(f"{e['system']}: {e['batch_rule'].get('rule')}"
                                              for e in doc["systems"] if e.get("batch_rule")) + "."]
    runs = [(e["system"], r) for e in doc["systems"] for r in e["runs"]]
    if runs:
        lines += ["", "| run | batch | tok/s | wall s | peak RSS GiB | answer min / p10 / p25 / median / p75 / p90 / max |",
                  "|---|---|---|---|---|---|"]
        for name, r in runs:
            if r.get("status") != "ran":
                lines.append(f"| {name} r{r['repeat']} | {r['batch']} | {r.get('status')}: {r.get('reason', '')[:200]} |")
                continue
            al = r["answer_len"]
            lines.append(f"| {name} r{r['repeat']} | {r['batch']} | {_f(r['tok_s'], 2)} | {_f(r['wall_s'])} | "
                         f"{r['peak_rss_bytes'] / GIB:.2f} | " + " / ".join(
                             f"{al[k]:.0f}" for k in ("min", "p10", "p25", "median", "p75", "p90", "max")) + " |")
    png = plot_lengths(doc, out)
    if png:
        lines += ["", f"![answer lengths]({png})"]
    md = "\n".join(lines) + "\n"
    (out / "results.md").write_text(md)
    return md


def plot_lengths(doc: dict[str, Any], out: Path) -> str | None:
    """A histogram of answer lengths per system (each system's first successful run)."""
    series = []
    for e in doc["systems"]:
        ok = [r for r in e["runs"] if r.get("status") == "ran"]
        if ok:
            series.append((e["system"], ok[0]["lengths"]))
    if not series:
        return None
    import matplotlib
    matplotlib.use("Agg")                 # no display on benchmark machines
    import matplotlib.pyplot as plt
    top = doc["job"]["max_new_tokens"]
    bins = list(range(0, top + 2, max(1, (top + 1) // 32)))
    # one panel per system, shared axes: the distributions often coincide and would hide each other in one
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 1.2 + 1.3 * len(series)), sharex=True, sharey=True,
                             squeeze=False)
    for ax, (name, xs) in zip(axes[:, 0], series):
        ax.hist(xs, bins=bins, color="tab:blue")
        ax.set_ylabel("prompts", fontsize=8)
        ax.set_title(name, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("answer length (generated tokens, EOS counted)")
    fig.suptitle(f"Chat workload: answer lengths, {doc['job']['n_prompts']} prompts, max {top} new tokens")
    fig.tight_layout()
    fig.savefig(out / "answer_lengths.png", dpi=110)
    plt.close(fig)
    return "answer_lengths.png"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "benchmarks/results/chat")
    print(write_report(json.loads((out / "results.json").read_text()), out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
