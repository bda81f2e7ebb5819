"""The EvictionPolicy protocol and the registry of policies by name.

A policy is stateless: pure functions of the tensors the cache keeps per slot (fp32 scores, original
positions with -1 for empty). The cache owns bytes and state; the policy owns decisions (`docs/architecture.md`).
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from flexgen_h2o.kv.budget import Budget, EvictionConfig, RowBudgets
from flexgen_h2o.kv.registry import get_policy


class EvictionPolicy(Protocol):
    # set from the policy's spec by registry.get_policy
    name: str
    needs_scores: bool          # True: attention must return the per-key mass (the slower, unfused path)
    compiled_rule: int | None

    def select_prefill(self, scores: Tensor | None, positions: Tensor, budget: Budget | RowBudgets,
                       generator: torch.Generator | None = None) -> Tensor:
        """scores (b, g, p) fp32 column sums over the real queries (None if not needs_scores); positions
        (b, g, p) long, -1 for pads -> keep (b, g, p) bool, at most budget.budget per column, no pads."""
        ...

    def choose_victim(self, scores: Tensor, positions: Tensor, budget: Budget | RowBudgets,
                      generator: torch.Generator | None = None) -> Tensor:
        """After a decode step has written its token and added its attention: scores (b, g, s) fp32,
        positions (b, g, s) long (-1 = free) -> victim slot (b, g) long, -1 where the column is within budget."""
        ...



def policy_for(config: EvictionConfig, budget: Budget | RowBudgets) -> EvictionPolicy:
    """The policy a run uses: the configured one, or `full` when the budget holds the whole run (same slots, the
    fused attention, bit-identical output)."""
    return get_policy(config.policy if budget.evicts else "full")
