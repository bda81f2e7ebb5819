"""H2O eviction: sinks + heavy hitters + a recent window, with the exact victim rule or the port's.

Per (sequence, KV head) column, once the valid slots exceed the budget:
- candidates = valid slots that are neither sinks (position < sink) nor among the `recent` newest;
  that is the heavy hitters plus the token just leaving the recent window (or the new token when recent = 0);
- exact (default): evict the lowest accumulated score among the candidates (the H2O paper's rule): a leaving
  token that scores below every heavy hitter is simply dropped;
- port: the leaving token (the newest candidate) is always admitted and the victim is the lowest-scored of
  the others, as in FMInference/H2O h2o_flexgen, where one heavy slot behaves like an extra recent slot;
- avg: the exact rule on each key's accumulated attention divided by the number of queries that have seen it
  (kvpress's ObservedAttention score). The sum favours old keys: a key early in a 2k prompt collects from ~2,000
  queries, one near its end from ~200. Every key in the cache
  has been attended by every query since it arrived, so that count is newest position - position + 1 and needs
  no state of its own.
Ties go to the smallest position (select.argmin_score). The random policy keeps the H2O shape but evicts a
uniformly random candidate: the "are scores doing anything" baseline.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flexgen_h2o.kv.adaptive import adaptive_keep
from flexgen_h2o.kv.budget import Budget, RowBudgets
from flexgen_h2o.kv.draws import KeyedDraws, draws_for
from flexgen_h2o.kv.select import NO_VICTIM, argmin_score, expand_positions, keep_prefill, newest_mask, uniform_choice


def h2o_candidates(positions: Tensor, budget: Budget | RowBudgets) -> tuple[Tensor, Tensor]:
    """(candidates (b, g, s) bool, over (b, g) bool): who may be evicted, and which columns must evict (each
    sequence against its own budget)."""
    valid = positions >= 0
    n_valid = valid.sum(dim=-1)
    over = n_valid > budget.col("budget", n_valid)
    window = newest_mask(positions, valid, budget.col("recent", positions), n_valid)
    candidates = valid & (positions >= budget.sink) & ~window
    return candidates, over


def prefill_keep(positions: Tensor, rank: Tensor | None, budget: Budget | RowBudgets) -> Tensor:
    """select.keep_prefill with each sequence's own counts, or kv/adaptive.py's allocation where the budget's heads
    share their slots."""
    if budget.head_floor is not None:
        return adaptive_keep(positions, rank, budget)
    return keep_prefill(positions, rank, budget.sink, budget.col("heavy", positions), budget.col("recent", positions),
                        budget.col("budget", positions))


def _only_over(victim: Tensor, over: Tensor) -> Tensor:
    # fill-first: a column at or under its budget keeps everything
    return torch.where(over, victim, torch.full_like(victim, NO_VICTIM))


class H2OPolicy:
    """Exact H2O: argmin over {heavy hitters} ∪ {the token leaving the recent window}."""

    def rank(self, scores: Tensor, positions: Tensor) -> Tensor:
        """What keys are ranked by, in prefill and at every victim choice: the accumulated attention itself."""
        return scores

    def select_prefill(self, scores: Tensor | None, positions: Tensor, budget: Budget | RowBudgets,
                       generator: torch.Generator | None = None) -> Tensor:
        return self.keep_and_scores(scores, positions, budget, generator)[0]

    def keep_and_scores(self, scores: Tensor | None, positions: Tensor, budget: Budget | RowBudgets,
                        generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """The prompt rows to keep (b, g, p) and the scores the kept keys start decode from, in one pass: here the
        column sums themselves (kv/snapkv.py starts from its pooled mass)."""
        if scores is None:
            raise ValueError(f"policy {self.name!r} ranks prompt tokens by attention: pass the column sums")
        positions = expand_positions(positions, scores)
        return prefill_keep(positions, self.rank(scores, positions), budget), scores

    def choose_victim(self, scores: Tensor, positions: Tensor, budget: Budget | RowBudgets,
                      generator: torch.Generator | None = None) -> Tensor:
        positions = expand_positions(positions, scores)
        candidates, over = h2o_candidates(positions, budget)
        return _only_over(argmin_score(self.rank(scores, positions), positions, candidates), over)


def per_query_average(scores: Tensor, positions: Tensor) -> Tensor:
    """(b, g, s) accumulated scores divided by how many queries saw each key: the queries from the key's own
    position to the column's newest. Empty slots (-1) sort below every real position, so a plain amax finds the
    newest; their own quotient is finite and never read (they are not candidates). Four small ops: this runs
    per layer at every decode step."""
    seen = (positions.amax(dim=-1, keepdim=True) + 1 - positions).clamp_(min=1)
    return scores / seen


class H2OAveragePolicy(H2OPolicy):
    """The exact rule, ranking by the per-query average attention instead of the sum."""

    def rank(self, scores: Tensor, positions: Tensor) -> Tensor:
        return per_query_average(scores, positions)


class H2OPortPolicy(H2OPolicy):
    """The port's approximation: the token leaving the window always enters the heavy set."""

    def choose_victim(self, scores: Tensor, positions: Tensor, budget: Budget | RowBudgets,
                      generator: torch.Generator | None = None) -> Tensor:
        positions = expand_positions(positions, scores)
        candidates, over = h2o_candidates(positions, budget)
        # the leaving token is the newest candidate; positions are unique in a column, so comparing with the
        # newest candidate position marks it without a scatter (-1 where a column has no candidate)
        candidate_pos = torch.where(candidates, positions, torch.full_like(positions, -1))
        newest_pos = candidate_pos.amax(dim=-1, keepdim=True)
        victim = argmin_score(self.rank(scores, positions), positions, candidates & (positions != newest_pos))
        # no heavy hitter to evict (heavy = 0): the leaving token has to go after all. A column over its budget
        # always has a candidate, and _only_over drops the others
        return _only_over(torch.where(victim == NO_VICTIM, candidate_pos.argmax(dim=-1), victim), over)


class RandomPolicy:
    """H2O's shape (sinks + heavy + recent) with the heavy set chosen and evicted uniformly at random."""

    def select_prefill(self, scores: Tensor | None, positions: Tensor, budget: Budget | RowBudgets,
                       generator: KeyedDraws | torch.Generator | None = None) -> Tensor:
        positions = expand_positions(positions, scores)
        return prefill_keep(positions, draws_for(generator, positions, -1), budget)

    def choose_victim(self, scores: Tensor, positions: Tensor, budget: Budget | RowBudgets,
                      generator: KeyedDraws | torch.Generator | None = None) -> Tensor:
        positions = expand_positions(positions, scores)
        candidates, over = h2o_candidates(positions, budget)
        step = positions.amax(dim=-1, keepdim=True)               # the newest token: one key per decode step
        return _only_over(uniform_choice(candidates, draws_for(generator, positions, step)), over)
