"""Needle retrieval: a 5-digit pass key planted at depths 10-90 % of a long prompt, asked for at the end.

The answer is teacher-forced, so one run gives both figures: `exact` (every answer token was the argmax, which
is exactly what greedy decoding would have produced, eviction included) and the answer's mean NLL, which moves
before exact match flips. With eviction the needle survives only if the prefill ranks it among the heavy
hitters (h2o), or it sits in the recent window (local, sink).
"""
from __future__ import annotations

from collections import defaultdict

from flexgen_h2o.eval.data import NeedleItem
from flexgen_h2o.eval.grid import GridPoint
from flexgen_h2o.eval.results import BlockCheckpoint, ResultStore
from flexgen_h2o.eval.runner import Runner


def run_needle(runner: Runner, store: ResultStore, items: list[NeedleItem], points: list[GridPoint]) -> None:
    todo = [p for p in points if not store.has(p.key)]
    if not todo:
        return
    results = runner.score_grid(todo, [it.prompt for it in items], [it.answer for it in items],
                                BlockCheckpoint(store), desc="needle")
    for point in todo:
        scored, info = results[point.key]
        by_depth: dict[int, list[bool]] = defaultdict(list)
        nll_by_depth: dict[int, list[float]] = defaultdict(list)
        for it, s in zip(items, scored):
            by_depth[it.depth].append(all(s.hit))
            nll_by_depth[it.depth].append(sum(s.nll) / len(s.nll))
        exact = [all(s.hit) for s in scored]
        store.put(point.key, {
            "policy": point.policy, "budget": point.budget.label if point.budget else "full",
            "accuracy": sum(exact) / len(exact),
            "answer_nll": sum(sum(s.nll) / len(s.nll) for s in scored) / len(scored),
            # JSON keys are strings; depths are percent of the filler
            "accuracy_by_depth": {str(d): sum(v) / len(v) for d, v in sorted(by_depth.items())},
            "nll_by_depth": {str(d): sum(v) / len(v) for d, v in sorted(nll_by_depth.items())},
            **info.as_dict()})
