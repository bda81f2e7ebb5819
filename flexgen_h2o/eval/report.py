"""Markdown tables, PNG plots and the issue's target checks, built from the checkpoint JSON files alone.

So a report can be rebuilt at any time (`--report-only`), also from a partial run: missing points are "–".
"""
from __future__ import annotations

from pathlib import Path
from statistics import median

from flexgen_h2o.eval.grid import parse_budget
from flexgen_h2o.eval.report_retrieval import haystack_section, ruler_section
from flexgen_h2o.eval.report_tables import (MISSING, budgets_and_policies, depth_heatmap, fmt, mark, meta_line,
                                            policy_grid, pyplot, save_figure, table)
from flexgen_h2o.eval.results import load_results

TASKS = ("perplexity", "summarization", "streaming", "needle", "ruler", "haystack")


def _budget_plot(records: dict, prefix: str, value, ylabel: str, title: str, path: Path, log_y: bool = False) -> None:
    """Two panels (% of the sequence | absolute slots), budget on x, one line per policy, full dashed."""
    plt = pyplot()
    budgets, policies = budgets_and_policies(records, prefix)
    groups = [[b for b in budgets if b.endswith("%")], [b for b in budgets if not b.endswith("%")]]
    groups = [g for g in groups if g]
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    full = records.get(prefix + "full")
    for ax, group in zip(axes[0], groups):
        xs = [parse_budget(b).fraction * 100 if b.endswith("%") else parse_budget(b).slots for b in group]
        for p in policies:
            pts = [(x, value(records[f"{prefix}{p}@{b}"])) for x, b in zip(xs, group) if f"{prefix}{p}@{b}" in records]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=p)
        if full:
            ax.axhline(value(full), color="black", linestyle="--", label="full")
        ax.set_xlabel("KV budget (% of sequence)" if group[0].endswith("%") else "KV budget (slots)")
        if not group[0].endswith("%"):
            ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)


def perplexity_section(data: dict, out: Path) -> str:
    recs = data["records"]
    parts = ["## Perplexity", meta_line(data)]
    for corpus in data["meta"].get("corpora", []):
        prefix = f"{corpus}/"
        header, rows = policy_grid(recs, prefix, lambda r: r["ppl"])
        png = out / f"perplexity_{corpus}.png"
        _budget_plot(recs, prefix, lambda r: r["ppl"], "perplexity", f"Perplexity ({corpus})", png, log_y=True)
        parts += [f"### {corpus}", table(header, rows), f"![perplexity {corpus}]({png.name})"]
        header, rows = item_ratio_table(recs, prefix, ITEM_TABLE_BUDGET)
        if rows:
            parts += [f"Each window's perplexity at {ITEM_TABLE_BUDGET} over full's on the same window (one window "
                      "whose text copies from far back can carry the corpus figure):", table(header, rows)]
    parts.append("`*`: the budget held the whole sequence, so nothing was evicted (identical to full).")
    return "\n\n".join(parts)


ITEM_TABLE_BUDGET = "20%"     # the budget the perplexity targets name


def item_ratio_table(records: dict, prefix: str, budget: str) -> tuple[list[str], list[list[str]]]:
    """One row per window (item) of a corpus, one column per policy at `budget`: the window's perplexity over
    full's on the same window, then the median over windows. Empty without full or without such points."""
    full = records.get(prefix + "full")
    points = {r["policy"]: r for k, r in records.items()
              if k.startswith(prefix) and r.get("budget") == budget and not r.get("rolling") and "item_ppl" in r}
    if not full or not points or "item_ppl" not in full:
        return [], []
    base = full["item_ppl"]
    ratios = {p: [x / b for x, b in zip(r["item_ppl"], base)] for p, r in points.items()}
    rows = [[str(i), fmt(b)] + [f"{ratios[p][i]:.3f}" for p in points] for i, b in enumerate(base)]
    rows.append(["median", fmt(median(base))] + [f"{median(ratios[p]):.3f}" for p in points])
    return ["window", "full ppl", *points], rows


def summarization_section(data: dict, out: Path) -> str:
    recs = data["records"]
    parts = ["## Summarization (XSUM-style, Lee news)", meta_line(data)]
    header, rows = policy_grid(recs, "", lambda r: r["vs_reference"]["rouge2"], 4)
    parts += ["Rouge-2 against the lead sentence (seed 000's shape; KV size in slots or % of the sequence):",
              table(header, rows)]
    # a point run apart from the full cache (a merged run) has no fidelity: missing, not 1.0
    header, rows = policy_grid(recs, "", lambda r: r["vs_full"]["rouge2"] if r["vs_full"] else
                               (1.0 if r["policy"] == "full" else None), 4)
    parts += ["Fidelity: Rouge-2 against the full-cache summary of the same article:", table(header, rows)]
    detail = []
    for key, r in recs.items():
        ref, fid = r["vs_reference"], r["vs_full"]
        detail.append([key + mark(r)] + [fmt(ref[t], 4) for t in ("rouge1", "rouge2", "rougeL")]
                      + [fmt(fid[t], 4) if fid else ("1.0000" if key == "full" else MISSING)
                         for t in ("rouge1", "rouge2", "rougeL")])
    parts += ["All ROUGE F-measures (vs reference | vs full-cache output):",
              table(["point", "R-1", "R-2", "R-L", "R-1 fid", "R-2 fid", "R-L fid"], detail)]
    png = out / "summarization_rouge2.png"
    _budget_plot(recs, "", lambda r: r["vs_reference"]["rouge2"], "Rouge-2", "Summarization Rouge-2", png)
    parts.append(f"![summarization]({png.name})")
    return "\n\n".join(parts)


def streaming_section(data: dict, out: Path) -> str:
    recs = data["records"]
    full = recs.get("full")
    # the text itself gets easier or harder along one stream; full's own last 10 % is the control for that
    rows = [[k, fmt(r["ppl"]), fmt(r["ppl_first10"]), fmt(r["ppl_last10"]), fmt(r["last_over_first"], 3),
             fmt(r["ppl_last10"] / full["ppl_last10"], 3) if full else MISSING, str(r.get("slots_max") or "all")]
            for k, r in recs.items()]
    parts = ["## Streaming", meta_line(data),
             table(["point", "ppl", "first 10 %", "last 10 %", "last / first", "last 10 % / full's", "slots"], rows)]
    prefill = data["meta"].get("prefill", 0)
    header, per_window = window_table(recs, prefill)
    parts += ["Perplexity per window of the stream (× full's in the same window):", table(header, per_window)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, r in recs.items():
        ax.plot(_window_centres(r, prefill), r["window_ppl"], marker=".", label=k,
                linestyle="-" if r["rolling"] or k == "full" else ":")
    window = data["meta"].get("model_window")
    if window and window < prefill + max((len(r["nll_curve"]) for r in recs.values()), default=0):
        ax.axvline(window, color="red", alpha=0.5, label="model window")
    ax.set_xlabel("stream position (tokens)")
    ax.set_ylabel("perplexity (per window)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    parts.append(f"![streaming]({save_figure(fig, out / 'streaming.png')})")
    return "\n\n".join(parts)


def _window_centres(rec: dict, prefill: int) -> list[float]:
    """Stream position of the middle of each of a point's perplexity windows (equal stretches of the curve)."""
    w, n = rec["window_ppl"], len(rec["nll_curve"])
    return [prefill + (i + 0.5) * n / len(w) for i in range(len(w))]


def window_table(recs: dict, prefill: int) -> tuple[list[str], list[list[str]]]:
    """One row per window of the stream, one column per point: the window's perplexity and, for the other
    points, its ratio to full's in the same window. Window by window the text's own difficulty cancels out of
    the ratio, so a collapse past the model's window would show there."""
    full = recs.get("full")
    first = next(iter(recs.values()), None)
    centres = _window_centres(first, prefill) if first else []
    rows = []
    for i, centre in enumerate(centres):
        cells = [f"{centre:.0f}"]
        for k, r in recs.items():
            ratio = f" ({r['window_ppl'][i] / full['window_ppl'][i]:.3f}×)" if full and k != "full" else ""
            cells.append(fmt(r["window_ppl"][i]) + ratio)
        rows.append(cells)
    return ["window centre (token)", *recs], rows


def needle_section(data: dict, out: Path) -> str:
    recs = data["records"]
    depths = data["meta"].get("depths", [])
    rows = [[k + mark(r), fmt(r["accuracy"])] + [fmt(r["accuracy_by_depth"].get(str(d))) for d in depths]
            + [fmt(r["answer_nll"], 3)] for k, r in recs.items()]
    parts = ["## Needle retrieval (pass key)", meta_line(data),
             table(["point", "accuracy"] + [f"{d} %" for d in depths] + ["answer NLL"], rows)]
    if recs:
        parts.append(f"![needle]({depth_heatmap(recs, depths, 'exact-match accuracy', out / 'needle.png')})")
    return "\n\n".join(parts)


def target_checks(results: dict[str, dict]) -> list[str]:
    """The issue's targets, where the run has the points they need."""
    lines = []
    ppl = (results.get("perplexity") or {}).get("records", {})
    for corpus in (results.get("perplexity") or {}).get("meta", {}).get("corpora", []):
        get = lambda k: (ppl.get(f"{corpus}/{k}") or {}).get("ppl")   # noqa: E731
        h2o, full, local, sink = get("h2o@20%"), get("full"), get("local@20%"), get("sink@20%")
        if h2o and full:
            lines.append(f"- {corpus}: h2o@20% perplexity / full = {h2o / full:.3f} (target <= 1.10: "
                         f"{'met' if h2o / full <= 1.10 else 'MISSED'})")
        for name, other in (("local", local), ("sink", sink)):
            if h2o and other:
                lines.append(f"- {corpus}: h2o@20% {h2o:.2f} vs {name}@20% {other:.2f} (target below: "
                             f"{'met' if h2o < other else 'MISSED'})")
    summ = (results.get("summarization") or {}).get("records", {})
    if "h2o@20%" in summ and "full" in summ:
        a, b = summ["h2o@20%"]["vs_reference"]["rouge2"], summ["full"]["vs_reference"]["rouge2"]
        if b > 0:
            lines.append(f"- summarization: Rouge-2 h2o@20% / full = {a / b:.3f} (target >= 0.95: "
                         f"{'met' if a / b >= 0.95 else 'MISSED'})")
        else:
            lines.append("- summarization: full-cache Rouge-2 is 0, so the ratio target cannot be judged")
    for k, r in ((results.get("streaming") or {}).get("records", {})).items():
        if r.get("rolling"):
            lines.append(f"- streaming {k}: last 10 % / first 10 % = {r['last_over_first']:.3f} (target <= 1.2: "
                         f"{'met' if r['last_over_first'] <= 1.2 else 'MISSED'})")
    return lines


def write_report(out_dir: str | Path, title: str = "Accuracy report") -> Path:
    out = Path(out_dir)
    results = {t: load_results(out, t) for t in TASKS}
    builders = {"perplexity": perplexity_section, "summarization": summarization_section,
                "streaming": streaming_section, "needle": needle_section, "ruler": ruler_section,
                "haystack": haystack_section}
    parts = [f"# {title}"]
    for task in TASKS:
        if results[task] and results[task]["records"]:
            parts.append(builders[task](results[task], out))
    checks = target_checks(results)
    if checks:
        parts += ["## Targets", "\n".join(checks)]
    path = out / "report.md"
    path.write_text("\n\n".join(parts) + "\n")
    return path
