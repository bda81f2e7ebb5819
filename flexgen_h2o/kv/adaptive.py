"""Head-adaptive budgets (AdaKV): a layer's slots shared by its KV heads, taken by the best scores across them.

A uniform budget gives every KV head of a layer the same `budget` slots. Heads differ: one attends to a few keys
(its scores peak), another spreads its attention flat. AdaKV keeps the layer's total (`budget` times its KV heads)
but lets the heads compete for it, so a flat head gives slots to a peaked one:

1. each head keeps what its rule forces (the sinks and the recent window, or SnapKV's observation window) and
   its `floor` best keys (int(`head_floor` x its uniform budget), at least 1, counted with the forced ones:
   kvpress's AdaKVPress `alpha_safeguard`, the AdaKV paper's safeguard);
2. the rest of the layer's total goes to the best remaining scores of the layer's heads together.

A sequence whose prompt fits its uniform budget keeps every token, as the uniform rule does. Decode then runs the
policy's rule in each head against that head's own count (`Budget.head_floor` set; the cache stores heads of
different lengths in one pool: kv/ragged.py). Scores of different heads are comparable because each is an
attention mass (a probability summed over queries).
"""
from __future__ import annotations

import torch
from torch import Tensor

from flexgen_h2o.kv.budget import Budget, RowBudgets
from flexgen_h2o.kv.select import newest_mask, top_k_mask


def per_column(count: int | Tensor, like: Tensor) -> Tensor:
    """A budget count (one int, or (b, 1, 1) per sequence) as a long tensor broadcasting against (b, g, 1)."""
    if isinstance(count, Tensor):
        return count.to(like.device)
    return torch.full((1, 1, 1), count, dtype=torch.long, device=like.device)


def adaptive_keep(positions: Tensor, rank: Tensor | None, budget: Budget | RowBudgets) -> Tensor:
    """(b, g, p) bool: the prompt rows each KV head keeps. positions (b, g, p) long (-1 pads); rank (b, g, p): the
    policy's ranking of the keys (higher is kept first). Each sequence keeps g * budget rows in all, each head at
    least its forced rows and its floor; a head may keep more than its uniform budget. Ties across heads go to the
    newer position, then the lower head: a choice that depends on the sequence alone, never on its batch."""
    b, g, p = positions.shape
    valid = positions >= 0
    per_head = per_column(budget.col("budget", positions), positions)              # (b or 1, 1, 1)
    if rank is None:
        rank = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
    forced = valid & (positions < budget.sink)
    forced |= newest_mask(positions, valid, budget.col("recent", positions))
    rest = valid & ~forced
    # int(), at least 1 where the share is not 0: kvpress's AdaKVPress rounds so
    floor = (per_head.double() * budget.head_floor).long()
    if budget.head_floor > 0:
        floor = floor.clamp(min=1)
    safe = top_k_mask(rank, positions, rest, (floor - forced.sum(-1, keepdim=True)).clamp(min=0))
    protected = forced | safe
    left = per_head.view(-1) * g - protected.sum(dim=(1, 2))                       # (b,) slots the heads share
    shared = top_k_mask(rank.reshape(b, 1, g * p), positions.reshape(b, 1, g * p),
                        (rest & ~safe).reshape(b, 1, g * p), left.view(-1, 1, 1)).view(b, g, p)
    n_real = valid.sum(dim=-1, keepdim=True)
    return torch.where(n_real <= per_head, valid, protected | shared)
