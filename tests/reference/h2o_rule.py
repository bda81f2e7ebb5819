"""The H2O rule on plain Python lists: which prompt rows a prefill keeps and which slot a decode step evicts.

The masked reference (h2o_masked.py) applies it to a full-cache model, and tests/kv uses it as the brute-force
oracle of the engine's vectorised policies. Nothing here imports flexgen_h2o."""
from __future__ import annotations

from typing import Sequence


def prefill_candidates(positions: Sequence[int], sink: int, recent: int) -> tuple[set[int], list[int]]:
    """A prompt's rows kept whatever their scores (the sinks and the `recent` newest real tokens), and the other
    real rows, which compete on score. positions[i] = -1 marks a pad."""
    real = [i for i, p in enumerate(positions) if p >= 0]
    by_age = sorted(real, key=lambda i: positions[i])
    fixed = {i for i in real if positions[i] < sink}
    if recent > 0:
        fixed |= set(by_age[-recent:])
    return fixed, [i for i in real if i not in fixed]


def ref_keep_prefill(scores: Sequence[float], positions: Sequence[int], sink: int, heavy: int,
                     recent: int, flip_ties: bool = False) -> set[int]:
    """Indices of the prompt rows to keep. positions[i] = -1 marks a pad. flip_ties: equal scores keep the older
    token (the wrong order: tests show with it that a run's choices depend on the tie order)."""
    if sum(p >= 0 for p in positions) <= sink + heavy + recent:
        return {i for i, p in enumerate(positions) if p >= 0}
    keep, others = prefill_candidates(positions, sink, recent)
    tie = 1 if flip_ties else -1
    others.sort(key=lambda i: (-scores[i], tie * positions[i]))     # best score first; ties keep the newer token
    return keep | set(others[:heavy])


def victim_candidates(positions: Sequence[int], sink: int, recent: int, rule: str) -> list[int]:
    """The kept slots (positions[i] >= 0) a score-ranking rule may evict: the non-sinks outside the recent window;
    the port's also less the token leaving the window (admitted whatever its score) unless it is the only one."""
    valid = [i for i, p in enumerate(positions) if p >= 0]
    by_age = sorted(valid, key=lambda i: positions[i])
    window = set(by_age[len(by_age) - recent:]) if recent > 0 else set()
    candidates = [i for i in valid if positions[i] >= sink and i not in window]
    if rule == "port" and len(candidates) > 1:
        candidates.remove(max(candidates, key=lambda i: positions[i]))
    return candidates


def ref_victim(scores: Sequence[float], positions: Sequence[int], sink: int, heavy: int, recent: int,
               rule: str, flip_ties: bool = False) -> int | None:
    """Index to evict among the slots with positions[i] >= 0, or None while within the budget. flip_ties: equal
    scores evict the newer token (the wrong order, see ref_keep_prefill)."""
    valid = [i for i, p in enumerate(positions) if p >= 0]
    if rule == "full" or len(valid) <= sink + heavy + recent:
        return None
    if rule == "window":
        return min((i for i in valid if positions[i] >= sink), key=lambda i: positions[i])
    candidates = victim_candidates(positions, sink, recent, rule)
    return min(candidates, key=lambda i: (scores[i], -positions[i] if flip_ties else positions[i]))


def ref_window_pooled(scores: Sequence[float], positions: Sequence[int], window: int, kernel: int) -> list[float]:
    """SnapKV's prompt ranking: each real key's score (its mass from the last `window` queries) averaged over the
    `kernel` indices around it, where pads, indices past either end and the window's own keys count as 0 and
    the divisor is always `kernel`; the window's keys rank above everything (inf)."""
    newest = max(p for p in positions if p >= 0)
    in_window = [p >= 0 and p > newest - window for p in positions]
    mass = [s if p >= 0 and not w else 0.0 for s, p, w in zip(scores, positions, in_window)]
    half, n = kernel // 2, len(mass)
    pooled = [sum(mass[j] for j in range(i - half, i + half + 1) if 0 <= j < n) / kernel for i in range(n)]
    return [float("inf") if w else v for v, w in zip(pooled, in_window)]


def ref_adaptive_keep(rankings: Sequence[Sequence[float]], positions: Sequence[int], sink: int, heavy: int,
                      recent: int, floor_share: float) -> list[set[int]]:
    """Head-adaptive budgets (AdaKV) for one sequence of one layer: per KV head, the prompt rows it keeps.
    rankings[h][i]: head h's ranking of row i. Every head keeps its sinks and recent window and its best rows up
    to int(floor_share * budget) in all; the rest of the layer's g * budget rows go to the best remaining
    (head, row) pairs of all heads, ties to the newer position, then the lower head. The floor is at least 1 where
    floor_share is not 0. A prompt within the budget
    keeps every real row in every head."""
    budget = sink + heavy + recent
    real = [i for i, p in enumerate(positions) if p >= 0]
    if len(real) <= budget:
        return [set(real) for _ in rankings]
    fixed, others = prefill_candidates(positions, sink, recent)
    floor = max(1, int(budget * floor_share)) if floor_share > 0 else 0
    keeps = []
    for ranking in rankings:
        best = sorted(others, key=lambda i: (-ranking[i], -positions[i]))
        keeps.append(set(fixed) | set(best[:max(0, floor - len(fixed))]))
    shared = sorted(((h, i) for h in range(len(rankings)) for i in others if i not in keeps[h]),
                    key=lambda hi: (-rankings[hi[0]][hi[1]], -positions[hi[1]], hi[0]))
    for h, i in shared[:len(rankings) * budget - sum(len(k) for k in keeps)]:
        keeps[h].add(i)
    return keeps
