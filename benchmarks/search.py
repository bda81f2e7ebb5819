"""The suite's batch search: the best batch of one system within a workload's budget, from short probes (pure:
`probe` is injected, so tests drive it with a fake; docs/suite.md "The batch search")."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from benchmarks.common import CaseFailed, median
from benchmarks.suite_report import CAPPED_BEST
from benchmarks.systems import Candidate

# a probe this much below the best so far ends the search: two probes of one system drift by more than a few
# percent on a shared VM, and a tighter margin ended searches at batch 1 (docs/suite.md "The batch search")
SLOWER = 0.85
# a candidate the planner puts at most this far over the budget is probed and its measured peak decides: the
# planner runs a little high on the disk shapes, so the batch at the budget's edge was never tried (same section)
PLANNER_EDGE = 1.08


@dataclass
class Step:
    candidate: Candidate
    status: str                              # ok | best | over budget (planner|measured) | slower | failed | ...
    projected_peak_bytes: int | None = None
    projected_total_tok_s: float | None = None


@dataclass
class SearchResult:
    best: Candidate | None
    steps: list[Step] = field(default_factory=list)


def project_probe(row: dict[str, Any], gen_len: int, growth_bytes: int, peak_bytes: int) -> tuple[float, int]:
    """(total tok/s, peak bytes) a probe of row['gen_len'] tokens projects for gen_len: the median decode step
    (first step left out: it pays one-off costs) repeated, plus the bytes the cache would still grow. peak_bytes:
    the probe's peak the budget is about (Workload.peak_bytes: RSS, or GPU memory for a GPU workload)."""
    steps = row["step_times_s"][1:] or row["step_times_s"]
    step = median(steps) if steps else row["decode_s"] / max(row["gen_len"] - 1, 1)
    total = row["batch"] * gen_len / (row["prefill_s"] + step * (gen_len - 1))
    return total, peak_bytes + growth_bytes


def search_batch(cands: list[Candidate], probe: Callable[[Candidate], tuple[float, int]], budget: int, *,
                 order: str = "up", max_probes: int = 6) -> SearchResult:
    """The best batch within `budget`. probe(c) -> (projected total tok/s, projected peak bytes), or raises
    CaseFailed. "up": ascending until over budget, slower, or failed. "down": the planner's admitted candidates
    from the largest, skipping measured over-budget ones, until one is slower than the best so far.
    A candidate the planner puts within PLANNER_EDGE of the budget is probed too; its measured peak decides.
    A lone candidate the planner fits within the budget is taken without a probe."""
    res = SearchResult(None)
    admitted = [c for c in cands if c.predicted_bytes is None or c.predicted_bytes <= budget * PLANNER_EDGE]
    rejected = [Step(c, "over budget (planner)", c.predicted_bytes) for c in cands if c not in admitted]
    # only a candidate the planner fits may skip the probe: one at its edge is over budget until measured
    if len(admitted) == 1 and (admitted[0].predicted_bytes or 0) <= budget:
        res.best = admitted[0]
        res.steps = [Step(admitted[0], "best (only candidate, not probed)", admitted[0].predicted_bytes)] + rejected
        return res
    order_list = admitted if order == "up" else admitted[::-1]
    best_tps, probes, capped_best = 0.0, 0, None
    for i, c in enumerate(order_list):
        if probes >= max_probes:
            if order == "up" and res.steps and res.steps[-1].candidate == res.best:
                capped_best = res.best      # the cap, not a slower or over-budget probe, ended the search
            res.steps += [Step(x, "not probed (probe cap)") for x in order_list[i:]]
            break
        probes += 1
        try:
            tps, peak = probe(c)
        except CaseFailed as e:
            res.steps.append(Step(c, f"failed: {str(e).strip().splitlines()[-1][:120]}"))
            if order == "up":
                break
            continue
        if peak > budget:
            res.steps.append(Step(c, "over budget (measured)", peak, tps))
            if order == "up":
                break
            continue
        slower = res.best is not None and tps < SLOWER * best_tps
        res.steps.append(Step(c, "slower" if slower else "ok", peak, tps))
        if not slower and tps > best_tps:
            res.best, best_tps = c, tps
        if slower:
            break
    for s in res.steps:
        if s.candidate == res.best:
            s.status = CAPPED_BEST if res.best == capped_best else "best"
    res.steps += rejected
    return res
