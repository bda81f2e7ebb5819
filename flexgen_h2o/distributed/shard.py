"""Which prompts each data-parallel rank generates: balanced by tokens, not by count.

A prompt's work is its prompt tokens plus the tokens it may generate (its max_new_tokens): the prompt pass
reads each prompt token once, every decode step attends the whole kept context. Longest first, each prompt
goes to the rank with the least work so far (ties: the lower rank); a rank's share keeps input order. Every
rank computes the same split from the same pending list, so nothing is sent.
"""
from __future__ import annotations

from typing import Sequence


def prompt_work(prompt_tokens: int, max_new_tokens: int) -> int:
    return prompt_tokens + max_new_tokens


def shard_by_tokens(work: Sequence[int], n_ranks: int) -> list[list[int]]:
    """Indices into `work` for each of `n_ranks`, in ascending order; total work as even as greedy gets."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    load = [0] * n_ranks
    shares: list[list[int]] = [[] for _ in range(n_ranks)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        r = min(range(n_ranks), key=lambda r: (load[r], r))
        load[r] += work[i]
        shares[r].append(i)
    return [sorted(s) for s in shares]
