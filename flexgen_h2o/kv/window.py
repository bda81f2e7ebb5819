"""Score-free baselines at equal budgets: the full cache, a local window, and sinks + window (StreamingLLM).

`local` and `sink` are one rule: keep the `sink` first tokens and the newest tokens, evict the oldest
non-sink. They differ only in the sink count the budget carries (0 for local, 4 by default for sink, as in
StreamingLLM). Any heavy share in a hand-built Budget is treated as window, so the kept count is always the
budget.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flexgen_h2o.kv.budget import Budget, RowBudgets
from flexgen_h2o.kv.select import NO_VICTIM, expand_positions, keep_prefill, oldest


class FullPolicy:
    """Keeps every real token; the capacity is prompt_len + gen_len."""

    def select_prefill(self, scores: Tensor | None, positions: Tensor, budget: Budget | RowBudgets,
                       generator: torch.Generator | None = None) -> Tensor:
        return expand_positions(positions, scores) >= 0

    def choose_victim(self, scores: Tensor, positions: Tensor, budget: Budget | RowBudgets,
                      generator: torch.Generator | None = None) -> Tensor:
        b, g = scores.shape[:2]
        return torch.full((b, g), NO_VICTIM, dtype=torch.long, device=scores.device)


class WindowPolicy:
    """Sinks + a recent window; the victim is the oldest token that is not a sink."""

    def select_prefill(self, scores: Tensor | None, positions: Tensor, budget: Budget | RowBudgets,
                       generator: torch.Generator | None = None) -> Tensor:
        positions = expand_positions(positions, scores)
        window = budget.col("heavy", positions) + budget.col("recent", positions)
        return keep_prefill(positions, None, budget.sink, 0, window, budget.col("budget", positions))

    def choose_victim(self, scores: Tensor, positions: Tensor, budget: Budget | RowBudgets,
                      generator: torch.Generator | None = None) -> Tensor:
        positions = expand_positions(positions, scores)
        valid = positions >= 0
        n_valid = valid.sum(dim=-1)
        over = n_valid > budget.col("budget", n_valid)
        victim = oldest(positions, valid & (positions >= budget.sink))
        return torch.where(over, victim, torch.full_like(victim, NO_VICTIM))


class SinkPolicy(WindowPolicy):
    """StreamingLLM's cache shape: attention sinks + rolling window."""
