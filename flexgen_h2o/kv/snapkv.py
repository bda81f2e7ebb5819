"""SnapKV: prompt keys ranked by what the question attends to, then H2O.

The question sits at the end of a prompt, and the facts it needs are often keys the rest of the prompt never
dwelt on, which H2O's sum over every query ranks low. SnapKV ranks a prompt's keys by the attention of its last
`score_window` queries only (the observation window: EvictionConfig.score_window, which every scoring attention
path honours), averages each key's score with its `pool_kernel` neighbours so that the tokens around a hit
survive with it, and keeps the window itself (the budget's recent share). As kvpress's SnapKVPress does, the
window's own keys are left out of the pooling (their mass counts as 0 for their neighbours) and rank above
every other key, and the pooling counts the zeros beyond a sequence's ends in its divisor.

Decoding then continues as exact H2O: the cache keeps each key's pooled window mass (keep_and_scores) and
adds every step's attention to it (kv/h2o.py's rule, compiled rule 1). `docs/cli.md` "Which policy" says when to choose it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flexgen_h2o.kv.budget import Budget, RowBudgets
from flexgen_h2o.kv.h2o import H2OPolicy, prefill_keep
from flexgen_h2o.kv.select import expand_positions


def window_pooled(scores: Tensor, positions: Tensor, window: int, kernel: int) -> tuple[Tensor, Tensor]:
    """(pooled, in_window), both (b, g, p): each prompt key's window mass averaged over `kernel` neighbouring rows
    (zeros beyond the row's ends, pads and the window's own keys count as 0), and which keys are the window's.
    Rows are prompt order (pads first), so neighbours in a row are neighbours in the sequence. The kernel's
    terms are added in one fixed order whatever the padding, so a prompt ranks the same in any batch."""
    newest = positions.amax(dim=-1, keepdim=True)
    in_window = (positions >= 0) & (positions > newest - window)
    outside = (positions >= 0) & ~in_window
    mass = torch.where(outside, scores.float(), torch.zeros((), dtype=torch.float32, device=scores.device))
    if kernel > 1:
        half, p = kernel // 2, mass.shape[-1]
        padded = torch.nn.functional.pad(mass, (half, half))
        total = padded[..., 0:p].clone()
        for j in range(1, kernel):
            total += padded[..., j:j + p]
        mass = total / kernel
    return mass, in_window


class SnapKVPolicy(H2OPolicy):
    """Prefill: the sinks, the observation window and the best pooled window scores; decode: exact H2O."""

    def keep_and_scores(self, scores: Tensor | None, positions: Tensor, budget: Budget | RowBudgets,
                        generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Keep the window and the best pooled scores; the kept keys start decode from their pooled mass, which
        decode's H2O then adds to: a key kept for its neighbour's hit (the rest of a number whose first digit the
        question attends to) keeps that rank, where its own window mass would make it decode's first victim. The
        window's keys start from their own mass."""
        if scores is None:
            raise ValueError(f"policy {self.name!r} ranks prompt tokens by attention: pass the column sums")
        if budget.score_window is None:
            raise ValueError("snapkv ranks prompt keys by an observation window: the budget carries none")
        positions = expand_positions(positions, scores)
        pooled, in_window = window_pooled(scores, positions, budget.score_window, budget.pool_kernel)
        keep = prefill_keep(positions, torch.where(in_window, torch.full_like(pooled, float("inf")), pooled), budget)
        return keep, torch.where(in_window, scores.float(), pooled)
