"""Perplexity: prefill a context, teacher-force a continuation with eviction active at every step.

Only the continuation is scored: the prompt is prefilled with full attention (then cut to the budget), so the
continuation is where the evicted cache is actually used. Corpus perplexity = exp(total NLL / total tokens).
"""
from __future__ import annotations

import math
from typing import Sequence

from flexgen_h2o.eval.grid import GridPoint
from flexgen_h2o.eval.results import BlockCheckpoint, ResultStore
from flexgen_h2o.eval.runner import Runner, Scored


def perplexity(nll: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood (natural log)."""
    if not nll:
        raise ValueError("perplexity of zero tokens")
    return math.exp(sum(nll) / len(nll))


def summarize_scores(scored: list[Scored]) -> dict:
    """Corpus-level perplexity and top-1 accuracy, plus each item's perplexity (for spotting one bad item)."""
    all_nll = [x for s in scored for x in s.nll]
    all_hit = [h for s in scored for h in s.hit]
    return {"ppl": perplexity(all_nll), "nll_mean": sum(all_nll) / len(all_nll), "tokens": len(all_nll),
            "top1": sum(all_hit) / len(all_hit), "item_ppl": [round(perplexity(s.nll), 4) for s in scored]}


def run_perplexity(runner: Runner, store: ResultStore, items: dict[str, list[tuple[list[int], list[int]]]],
                   points: list[GridPoint]) -> None:
    """items: corpus name -> (context, continuation) pairs. One record per (corpus, point); the grid shares
    each block's prefill and checkpoints every (point, block)."""
    for corpus, pairs in items.items():
        todo = [p for p in points if not store.has(f"{corpus}/{p.key}")]
        if not todo:
            continue
        results = runner.score_grid(todo, [p for p, _ in pairs], [c for _, c in pairs],
                                    BlockCheckpoint(store, f"{corpus}/"), desc=f"ppl {corpus}")
        for point in todo:
            scored, info = results[point.key]
            store.put(f"{corpus}/{point.key}", {"corpus": corpus, "policy": point.policy,
                                                "budget": point.budget.label if point.budget else "full",
                                                "rolling": point.rolling, **summarize_scores(scored),
                                                **info.as_dict()})
