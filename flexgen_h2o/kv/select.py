"""Vectorised building blocks of the eviction rules: masks and deterministic arg-min / top-k over slots.

Every function works on (b, g, s) tensors at once, never loops over sequences or heads. Slots are unordered,
so every choice that could tie is broken by the token's original position, never by the slot index: two
caches that hold the same tokens in different slot orders must make the same decision.
"""
from __future__ import annotations

import torch
from torch import Tensor

NO_VICTIM = -1


def expand_positions(positions: Tensor, like: Tensor | None, shape: tuple[int, ...] | None = None) -> Tensor:
    """positions (b, s), (b, 1, s) or (b, g, s) -> long (b, g, s) matching `like` (or `shape`)."""
    target = tuple(like.shape) if like is not None else shape
    if positions.dim() == 2:
        positions = positions[:, None, :]
    if target is not None:
        positions = positions.expand(*target)
    return positions.long()


def newest_mask(positions: Tensor, valid: Tensor, k: int | Tensor, n_valid: Tensor | None = None) -> Tensor:
    """(b, g, s) bool: the k valid slots with the largest positions per column (all valid ones if fewer).
    k: one count, or one per sequence as a (b, 1, 1) tensor (RowBudgets.col). n_valid: valid.sum(-1), when the
    caller has it already (one reduction less per decode step and layer).

    Positions are unique among the valid slots of a column. A recent window is never evicted from, so in a
    cache the k newest positions are consecutive and "position > newest - k" finds them without a top-k over
    every column, which each decode step and layer would pay. The shortcut is checked (a column's
    count under it must be min(k, its valid count)); any column with a gap falls back to the exact ranking."""
    per_row = isinstance(k, Tensor)
    if not per_row and k <= 0:
        return torch.zeros_like(valid)
    masked = torch.where(valid, positions, torch.full_like(positions, -1))
    newest = masked.amax(dim=-1, keepdim=True)                                     # (b, g, 1)
    window = valid & (masked > newest - k)
    n_valid = valid.sum(dim=-1) if n_valid is None else n_valid
    expected = torch.minimum(n_valid, k.squeeze(-1)) if per_row else n_valid.clamp(max=k)
    if bool((window.sum(dim=-1) == expected).all()):
        return window
    if per_row:     # each row its own k: a slot's rank among its column's positions, newest first
        ranks = masked.argsort(dim=-1, descending=True).argsort(dim=-1)
        return valid & (ranks < k)
    k = min(k, positions.shape[-1])
    kth = masked.topk(k, dim=-1).values[..., -1:]                                  # (b, g, 1)
    return valid & (masked >= kth)


def argmin_score(scores: Tensor, positions: Tensor, candidates: Tensor) -> Tensor:
    """(b, g) slot of the lowest score among `candidates`; ties go to the smallest position. Columns without a
    candidate get NO_VICTIM."""
    key = torch.where(candidates, scores, torch.full_like(scores, float("inf")))
    tied = candidates & (key == key.amin(dim=-1, keepdim=True))                   # amin: no index pass
    return oldest(positions, tied)


def oldest(positions: Tensor, candidates: Tensor) -> Tensor:
    """(b, g) slot of the smallest position among `candidates` (NO_VICTIM where none)."""
    big = torch.iinfo(torch.long).max
    slot = torch.where(candidates, positions, torch.full_like(positions, big)).argmin(dim=-1)
    return torch.where(candidates.any(dim=-1), slot, torch.full_like(slot, NO_VICTIM))


def uniform_choice(candidates: Tensor, draw: Tensor) -> Tensor:
    """(b, g) the candidate slot with the largest draw per column (NO_VICTIM where none): uniform for i.i.d.
    draws (kv/draws.py)."""
    slot = torch.where(candidates, draw, torch.full_like(draw, -1.0)).argmax(dim=-1)
    return torch.where(candidates.any(dim=-1), slot, torch.full_like(slot, NO_VICTIM))


def top_k_mask(scores: Tensor, positions: Tensor, candidates: Tensor, k: int | Tensor) -> Tensor:
    """(b, g, s) bool: the k candidates with the highest scores per column (k: one count, or (b, 1, 1) per
    sequence). Ties keep the larger position, the mirror of argmin_score (the smaller position is evicted
    first), so a prefill selection equals what repeated single evictions would leave."""
    per_row = isinstance(k, Tensor)
    if not per_row and k <= 0:
        return torch.zeros_like(candidates)
    key = torch.where(candidates, scores.float(), torch.full_like(scores, float("-inf"), dtype=torch.float32))
    # two stable sorts = one sort by (score desc, position desc)
    by_pos = torch.where(candidates, positions, torch.full_like(positions, -1)).argsort(
        dim=-1, descending=True, stable=True)
    by_score = key.gather(-1, by_pos).argsort(dim=-1, descending=True, stable=True)
    order = by_pos.gather(-1, by_score)                                             # (b, g, s)
    if per_row:
        return candidates & (order.argsort(dim=-1) < k)
    chosen = torch.zeros_like(candidates)
    chosen.scatter_(-1, order[..., :min(k, order.shape[-1])], True)
    return chosen & candidates


def keep_prefill(positions: Tensor, scores: Tensor | None, sink: int, heavy: int | Tensor, recent: int | Tensor,
                 budget: int | Tensor) -> Tensor:
    """(b, g, p) bool: the prompt rows to keep. Columns with at most `budget` real tokens keep all of them;
    others keep the sinks (position < sink), the `recent` newest real tokens and the `heavy` best-scored of
    the rest. Pads (position -1) are never kept. heavy, recent, budget: counts, or (b, 1, 1) per sequence."""
    valid = positions >= 0
    n_real = valid.sum(dim=-1, keepdim=True)                                       # (b, g, 1)
    sinks = valid & (positions < sink)
    window = newest_mask(positions, valid, recent)
    rest = valid & ~sinks & ~window
    if scores is None:
        scores = torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
    heavy_mask = top_k_mask(scores, positions, rest, heavy)
    return torch.where(n_real <= budget, valid, sinks | window | heavy_mask)


def pack_kept(keep: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Turn a keep mask (b, g, p) into gather indices for `capacity` slots.

    Returns src (b, g, capacity) long, the prompt row that goes into each slot (0 for empty slots, so a
    gather stays in range), and filled (b, g, capacity) bool. Kept rows are packed first, in prompt order."""
    n_keep = keep.sum(dim=-1, keepdim=True)                                        # (b, g, 1)
    if int(n_keep.max()) > capacity:
        raise ValueError(f"{int(n_keep.max())} rows kept but only {capacity} slots")
    order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)                    # kept rows first
    p = keep.shape[-1]
    if p < capacity:
        order = torch.cat([order, order.new_zeros(*order.shape[:-1], capacity - p)], dim=-1)
    order = order[..., :capacity]
    filled = torch.arange(capacity, device=keep.device) < n_keep
    return torch.where(filled, order, torch.zeros_like(order)), filled
