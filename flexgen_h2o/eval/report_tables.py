"""The pieces every report section shares: number cells, markdown tables, the policy-by-budget grid, and the PNG
plumbing (matplotlib is optional: loaded only when a plot is drawn, setup.py's extras).

eval/report.py and eval/report_retrieval.py both build on these, so neither imports the other's helpers.
"""
from __future__ import annotations

from pathlib import Path

from flexgen_h2o.eval.grid import parse_budget

MISSING = "–"


def fmt(x: float | None, digits: int = 2) -> str:
    return MISSING if x is None else f"{x:.{digits}f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def budgets_and_policies(records: dict, prefix: str = "") -> tuple[list[str], list[str]]:
    """Budget labels (percentages first, then slots ascending) and evicting policies, in first-seen order."""
    budgets, policies = [], []
    for key, r in records.items():
        if not key.startswith(prefix) or r["budget"] == "full" or r.get("rolling"):
            continue
        budgets += [r["budget"]] if r["budget"] not in budgets else []
        policies += [r["policy"]] if r["policy"] not in policies else []

    def order(label: str):
        spec = parse_budget(label)
        return (0, spec.fraction) if spec.is_fraction else (1, spec.slots)
    return sorted(budgets, key=order), policies


def mark(r: dict) -> str:
    """'*' where no block evicted: the budget held the whole run, so the point is the full cache itself."""
    return "*" if r.get("blocks_evicting") == 0 and r.get("budget") != "full" else ""


def policy_grid(records: dict, prefix: str, value, digits: int = 2) -> tuple[list[str], list[list[str]]]:
    """A row per evicting policy, a column per budget and one for full: `value` of each point, marked as `mark`."""
    budgets, policies = budgets_and_policies(records, prefix)
    full = records.get(prefix + "full")
    header = ["policy"] + budgets + ["full"]
    rows = []
    for p in policies:
        cells = []
        for b in budgets:
            r = records.get(f"{prefix}{p}@{b}")
            cells.append(MISSING if r is None else fmt(value(r), digits) + mark(r))
        rows.append([p] + cells + [fmt(value(full), digits) if full else MISSING])
    return header, rows


def meta_line(data: dict) -> str:
    return "settings: " + ", ".join(f"{k}={v}" for k, v in data["meta"].items())


def pyplot():
    """matplotlib.pyplot on the file-only backend (a report runs headless)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path) -> str:
    """Write a figure as PNG and close it; returns the file name for the markdown link."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path.name


def depth_heatmap(recs: dict, depths: list[int], label: str, path: Path) -> str:
    """Each grid point's accuracy by needle depth as one heatmap row; returns the PNG's name."""
    plt = pyplot()
    keys = list(recs)
    grid = [[recs[k]["accuracy_by_depth"].get(str(d), float("nan")) for d in depths] for k in keys]
    fig, ax = plt.subplots(figsize=(3.5 + 0.7 * len(depths), 1.5 + 0.3 * len(keys)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d}%" for d in depths])
    ax.set_yticks(range(len(keys)), keys, fontsize=7)
    ax.set_xlabel("needle depth")
    fig.colorbar(im, ax=ax, label=label)
    return save_figure(fig, path)
