"""Streaming perplexity: one long text teacher-forced token by token, with and without position rolling.

The stream is meant to be longer than the model's context window. Without rolling, kept tokens keep their
true positions, so query-key distances grow past anything the model was trained on (for the full cache, and
for H2O's old heavy hitters). With rolling, keys are re-rotated by their rank in the cache, so distances stay
below the budget. The harness lifts the engine's "past the window needs --position-rolling" guard for this
task only, because the collapse without rolling is what is being measured.

RoPE only sees relative distances, so the collapse cannot be provoked more cheaply by pretending the window is
smaller: a stream must really hold more tokens than the trained window (8192 for SmolLM2's config).
"""
from __future__ import annotations

from flexgen_h2o.eval.grid import BudgetSpec, GridPoint
from flexgen_h2o.eval.perplexity import perplexity
from flexgen_h2o.eval.results import BlockCheckpoint, ResultStore
from flexgen_h2o.eval.runner import Runner


def streaming_points(policies: list[str], budget: BudgetSpec, heavy_share: float | None = None) -> list[GridPoint]:
    """full (true positions), then each evicting policy at one budget without and with rolling."""
    points = [GridPoint("full")] if "full" in policies else []
    for policy in policies:
        if policy != "full":
            points += [GridPoint(policy, budget, rolling, heavy_share) for rolling in (False, True)]
    return points


def window_ppl(nll: list[float], n_windows: int) -> list[float]:
    """Perplexity of n_windows equal consecutive stretches of the per-position NLL curve."""
    n = len(nll)
    edges = [round(i * n / n_windows) for i in range(n_windows + 1)]
    return [perplexity(nll[a:b]) for a, b in zip(edges, edges[1:]) if b > a]


def edge_ratio(nll: list[float]) -> dict:
    """Perplexity of the first and the last 10 % of the stream, and last / first (the flatness target)."""
    tenth = max(1, len(nll) // 10)
    first, last = perplexity(nll[:tenth]), perplexity(nll[-tenth:])
    return {"ppl_first10": first, "ppl_last10": last, "last_over_first": last / first}


def run_streaming(runner: Runner, store: ResultStore, streams: list[list[int]], prefill: int,
                  points: list[GridPoint], n_windows: int) -> None:
    prompts = [s[:prefill] for s in streams]
    conts = [s[prefill:] for s in streams]
    todo = [p for p in points if not store.has(p.key)]
    if not todo:
        return
    results = runner.score_grid(todo, prompts, conts, BlockCheckpoint(store), desc="stream")
    for point in todo:
        scored, info = results[point.key]
        # mean NLL per stream position (over the streams), the curve the plot shows
        curve = [sum(s.nll[t] for s in scored) / len(scored) for t in range(len(conts[0]))]
        store.put(point.key, {"policy": point.policy, "budget": point.budget.label if point.budget else "full",
                              "rolling": point.rolling, "ppl": perplexity(curve),
                              "window_ppl": window_ppl(curve, n_windows), **edge_ratio(curve),
                              "nll_curve": [round(x, 3) for x in curve], **info.as_dict()})
