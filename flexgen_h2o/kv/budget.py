"""Eviction configuration: what the user asked for (EvictionConfig) and the slot counts it means (Budget).

Counting rules (the flags' meanings: `docs/cli.md` "KV cache (H2O)"):
- `hh_ratio r` names heavy hitters only, as in the H2O FlexGen port: heavy = int(r * prompt_len); the recent
  window defaults to the same count, so `--hh-ratio 0.1` is a 20 % cache of the prompt ("H2O 0.1 + 0.1").
  For `h2o-port` the recent window defaults to heavy - 1, so heavy + recent + the current slot = 2 * hh_k rows,
  exactly the port's cache.
- Absolute sizes (`hh_size`, `recent_size`) override the ratios. Sinks are extra slots on top of them.
- `kv_budget N` names the total: sinks come out of it, the rest is split evenly (heavy = rest // 2).
- `local` and `sink` have no heavy hitters: the heavy share goes to the recent window, so they run at the same
  budget as h2o with the same flags. `sink` defaults to 4 sink tokens (StreamingLLM); `local` has none.

A Budget is one sequence's, per KV head, from its own real prompt length (padding excluded), as the H2O HF code
and the Llama recipe take it: a prompt keeps the same slots alone, in any batch, in any block cut and after any
resume. A block allocates one slot count for all its sequences (RowBudgets.capacity, its largest) and each
sequence evicts down to its own budget. `h2o-port` keeps the FlexGen port's per-block semantics instead: every
sequence of a block gets the budget of the block's padded length (EvictionConfig.per_block).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from flexgen_h2o.kv.page_rule import PageRule
from flexgen_h2o.kv.registry import DEFAULT_HEAD_FLOOR, policy_names, trait

SCORE_REDUCE = ("sum", "mean")
HEAD_BUDGETS = ("uniform", "adaptive")


@dataclass(frozen=True)
class Budget:
    """Slots per (sequence, KV head). `max_tokens` = prompt_len + gen_len caps the allocation: slots beyond the
    longest possible sequence would never be used."""
    sink: int
    heavy: int
    recent: int
    policy: str = "h2o"
    max_tokens: int | None = None
    # how a policy that ranks prompt keys reads their scores (EvictionConfig's): the last score_window queries
    # scored them, and a score is averaged over pool_kernel neighbouring keys (1: none)
    score_window: int | None = None
    pool_kernel: int = 1
    # head-adaptive budgets (kv/adaptive.py): None, every KV head keeps `budget` slots; a fraction, a layer's heads
    # share budget * heads slots, each keeping at least this fraction of `budget`
    head_floor: float | None = None

    @property
    def budget(self) -> int:
        """Valid slots kept after each step; eviction happens only while a column holds more than this."""
        return self.sink + self.heavy + self.recent

    @property
    def capacity(self) -> int:
        """Slots to allocate: the budget plus one free slot the new token is written into before eviction."""
        cap = self.budget + 1
        return cap if self.max_tokens is None else min(cap, self.max_tokens)

    @property
    def evicts(self) -> bool:
        """False when the budget can hold every token of the run (the cache is then a plain full cache)."""
        return self.policy != "full" and (self.max_tokens is None or self.budget < self.max_tokens)

    def col(self, name: str, like: Tensor) -> int:
        """The count `name` (heavy, recent or budget) for every column: one int (RowBudgets gives a tensor)."""
        return int(getattr(self, name))


@dataclass(frozen=True)
class RowBudgets:
    """A block's budgets, one Budget per sequence in row order. The cache allocates `capacity` slots for every row
    (the largest row's); the policies read each row's counts through col(), an int where the rows agree (the common
    case: a bucket of equal-length prompts, with no per-column tensor) and a (b, 1, ...) tensor where they differ."""
    rows: tuple[Budget, ...]
    _cols: dict = field(default_factory=dict, compare=False, repr=False)     # values and column tensors, made once

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("RowBudgets needs at least one row")
        if len({(r.sink, r.policy, r.score_window, r.pool_kernel, r.head_floor) for r in self.rows}) != 1:
            raise ValueError("the rows of a block share the sink count, the policy, its scoring and head budgets")

    @classmethod
    def uniform(cls, budget: Budget, n: int) -> "RowBudgets":
        return cls((budget,) * n)

    @property
    def policy(self) -> str:
        return self.rows[0].policy

    @property
    def sink(self) -> int:
        return self.rows[0].sink

    @property
    def score_window(self) -> int | None:
        return self.rows[0].score_window

    @property
    def pool_kernel(self) -> int:
        return self.rows[0].pool_kernel

    @property
    def head_floor(self) -> float | None:
        return self.rows[0].head_floor

    @property
    def capacity(self) -> int:
        if "max_capacity" not in self._cols:    # asked per row and per plan: the rows never change
            self._cols["max_capacity"] = max(r.capacity for r in self.rows)
        return self._cols["max_capacity"]

    @property
    def evicts(self) -> bool:
        return any(r.evicts for r in self.rows)

    def values(self, name: str) -> list[int]:
        if name not in self._cols:          # made once: col() runs per layer at every decode step
            self._cols[name] = [int(getattr(r, name)) for r in self.rows]
        return self._cols[name]

    def col(self, name: str, like: Tensor) -> int | Tensor:
        """Each row's `name` shaped to broadcast against `like` (b, ...) on its device; an int if the rows agree."""
        vals = self.values(name)
        if min(vals) == max(vals):
            return vals[0]
        key = (name, like.device, like.dim())
        if key not in self._cols:
            self._cols[key] = torch.tensor(vals, dtype=torch.long, device=like.device).view(-1, *[1] * (like.dim() - 1))
        return self._cols[key]

    def part(self, lo: int, hi: int) -> "RowBudgets":
        """The rows [lo, hi): a GPU batch of the block, or one tier's share of it."""
        return RowBudgets(self.rows[lo:hi])

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class EvictionConfig:
    """The user's eviction request. Field names say what they count; the CLI keeps the port's `--hh-ratio`."""
    policy: str = "full"                 # a registered policy (kv/registry.py)
    hh_ratio: float | None = None        # heavy hitters as a fraction of the prompt (the port's --hh-ratio)
    recent_ratio: float | None = None    # recent window as a fraction of the prompt (default: same as heavy)
    hh_size: int | None = None           # heavy hitters in slots (overrides hh_ratio)
    recent_size: int | None = None       # recent window in slots (overrides recent_ratio)
    sink_size: int | None = None         # pinned first tokens (default 4 for "sink", else 0)
    kv_budget: int | None = None         # total slots (sinks + heavy + recent), split evenly heavy/recent
    score_reduce: str = "sum"            # pooling of a GQA group's query heads into one KV head's score
    position_rolling: bool = False       # Llama: rotate kept keys by their rank (StreamingLLM style)
    seed: int = 0                        # for the random policy's generator
    # the prompt pass scores a key by the attention of the last score_window real queries of its sequence only
    # (the question at a prompt's end; docs/cli.md "KV cache (H2O)"); None: every real query, as H2O does
    score_window: int | None = None
    # SnapKV: a prompt key's score is the mean over this many neighbouring keys (odd; 1 = none). None: the policy's
    pool_kernel: int | None = None
    # "adaptive": a layer's KV heads share its budget, AdaKV's allocation (kv/adaptive.py); "uniform": each its own
    head_budgets: str = "uniform"
    head_floor: float = DEFAULT_HEAD_FLOOR   # adaptive: the least share of the uniform budget a head keeps
    pages: PageRule | None = None            # page selection (kv/pages.py): nothing evicted, pages read per step

    def __post_init__(self) -> None:
        if self.policy not in policy_names():
            raise ValueError(f"unknown eviction policy {self.policy!r}; choose one of {', '.join(policy_names())}")
        if self.pages is not None and (self.policy != "full" or self.position_rolling):
            raise ValueError("page selection reads a cache that keeps every token: drop eviction or --kv-select pages")
        # a policy's own defaults are filled in here, so everything downstream reads one value
        if self.score_window is None and trait(self.policy, "default_score_window") is not None:
            object.__setattr__(self, "score_window", trait(self.policy, "default_score_window"))
        if self.pool_kernel is None and trait(self.policy, "default_pool_kernel") is not None:
            object.__setattr__(self, "pool_kernel", trait(self.policy, "default_pool_kernel"))
        k = self.pool_kernel
        if k is not None:
            poolers = [p for p in policy_names() if trait(p, "default_pool_kernel") is not None]
            if self.policy not in poolers:
                raise ValueError(f"pool_kernel (--pool-kernel) averages prompt scores over neighbouring keys; policy "
                                 f"{self.policy!r} does not pool (it applies to {', '.join(poolers)})")
            if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
                raise ValueError(f"pool_kernel counts keys around each key and must be an odd integer >= 1, got {k!r}")
        if self.head_budgets not in HEAD_BUDGETS:
            raise ValueError(f"head_budgets must be one of {', '.join(HEAD_BUDGETS)}, got {self.head_budgets!r}")
        if self.head_budgets == "adaptive" and not trait(self.policy, "head_adaptive"):
            takers = [p for p in policy_names() if trait(p, "head_adaptive")]
            raise ValueError(f"head_budgets 'adaptive' (--head-budgets) lets a layer's KV heads compete for its slots "
                             f"by score, then evicts per head; policy {self.policy!r} cannot (it applies to "
                             f"{', '.join(takers)})")
        if isinstance(self.head_floor, bool) or not isinstance(self.head_floor, (int, float)) \
                or not 0.0 <= self.head_floor <= 1.0:
            raise ValueError(f"head_floor is a share of a head's uniform budget and must be in [0, 1], "
                             f"got {self.head_floor!r}")
        if self.score_reduce not in SCORE_REDUCE:
            raise ValueError(f"score_reduce must be 'sum' or 'mean', got {self.score_reduce!r}")
        n = self.score_window
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"score_window counts prompt queries and must be an integer >= 1, got {n!r}")
        for name in ("hh_ratio", "recent_ratio"):
            r = getattr(self, name)
            if r is not None and not 0.0 < r <= 1.0:
                raise ValueError(f"{name} is a fraction of the prompt length and must be in (0, 1], got {r} "
                                 f"(use hh_size / recent_size for absolute slot counts, 0 included)")
        for name in ("hh_size", "recent_size", "sink_size"):
            n = getattr(self, name)
            if n is not None and n < 0:
                raise ValueError(f"{name} counts slots and must be >= 0, got {n}")
        if self.kv_budget is not None:
            if self.kv_budget < 1:
                raise ValueError(f"kv_budget counts slots and must be >= 1, got {self.kv_budget}")
            given = [n for n in ("hh_ratio", "recent_ratio", "hh_size", "recent_size") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"kv_budget sets the total; do not combine it with {', '.join(given)}")
        if self.policy == "full":
            given = [n for n in ("hh_ratio", "recent_ratio", "hh_size", "recent_size", "sink_size", "kv_budget",
                                 "score_window") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"policy 'full' keeps every token; drop {', '.join(given)} or pick an evicting "
                                 f"policy ({', '.join(n for n in policy_names() if n != 'full')})")
        elif not self._has_budget():
            raise ValueError(f"policy {self.policy!r} needs a budget: hh_ratio (--hh-ratio), hh_size/recent_size, "
                             f"or kv_budget")
        if self.policy == "local" and self.sink_size:        # (sink is local with sinks)
            raise ValueError("policy 'local' is a plain recent window without sinks; use policy 'sink' for "
                             "sink tokens + window")
        if self.score_window is not None and (not self.needs_scores or trait(self.policy, "counts_every_query")):
            takers = [p for p in policy_names() if trait(p, "needs_scores") and not trait(p, "counts_every_query")]
            why = ("divides each key's mass by every query that saw it" if self.needs_scores
                   else "does not rank keys by attention")
            raise ValueError(f"score_window (--score-window) picks the prompt queries whose attention ranks the keys; "
                             f"policy {self.policy!r} {why} (it applies to {', '.join(takers)})")

    def _has_budget(self) -> bool:
        return any(getattr(self, n) is not None
                   for n in ("hh_ratio", "recent_ratio", "hh_size", "recent_size", "kv_budget"))

    @property
    def needs_scores(self) -> bool:
        return trait(self.policy, "needs_scores")

    @property
    def sinks(self) -> int:
        return self.sink_size if self.sink_size is not None else trait(self.policy, "default_sinks")

    def resolve(self, prompt_len: int, gen_len: int) -> Budget:
        """One sequence's slot counts, for `prompt_len` prompt tokens and `gen_len` new tokens."""
        if prompt_len < 1 or gen_len < 0:
            raise ValueError(f"need prompt_len >= 1 and gen_len >= 0, got {prompt_len} and {gen_len}")
        # the last generated token is never written, but keep room for gen_len >= 1 so capacity > any prompt
        max_tokens = prompt_len + max(gen_len, 1)
        if self.policy == "full":
            return Budget(0, 0, max_tokens, policy="full", max_tokens=max_tokens)
        sink = self.sinks
        if self.kv_budget is not None:
            rest = self.kv_budget - sink
            if rest < 0:
                raise ValueError(f"kv_budget {self.kv_budget} is smaller than the {sink} sink tokens")
            heavy, recent = rest // 2, rest - rest // 2
        else:
            heavy, recent = self._heavy_recent(prompt_len)
        if trait(self.policy, "window_only"):
            heavy, recent = 0, heavy + recent        # no heavy hitters: the whole share is the window
        elif trait(self.policy, "recent_is_score_window") and self.recent_size is None and self.recent_ratio is None:
            # SnapKV keeps its observation window and fills the rest by score; TOVA keeps only the newest token
            total = heavy + recent
            recent = min(self.score_window, total)
            heavy = total - recent
        if heavy < trait(self.policy, "min_heavy"):
            raise ValueError(f"{self.policy} needs at least one heavy hitter (the port asserts "
                             f"int(prompt_len * hh_ratio) > 0); got {heavy} for prompt_len {prompt_len}")
        if sink + heavy + recent < 1:
            raise ValueError(f"the eviction budget is 0 slots for prompt_len {prompt_len} ({self.describe_request()}); "
                             f"raise the ratio or give sizes in slots")
        return Budget(sink, heavy, recent, policy=self.policy, max_tokens=max_tokens, score_window=self.score_window,
                      pool_kernel=self.pool_kernel or 1,
                      head_floor=float(self.head_floor) if self.head_budgets == "adaptive" else None)

    def resolve_rows(self, prompt_lens: Sequence[int], gen_lens: Sequence[int]) -> RowBudgets:
        """Each sequence's budget from its own real prompt length and new tokens. h2o-port: the port's per-block
        budget, from the block's longest prompt (its padded length) and largest generation, for every row."""
        if len(prompt_lens) != len(gen_lens) or not prompt_lens:
            raise ValueError(f"need one gen length per prompt, got {len(prompt_lens)} and {len(gen_lens)}")
        if self.per_block:
            return RowBudgets.uniform(self.resolve(max(prompt_lens), max(gen_lens)), len(prompt_lens))
        return RowBudgets(tuple(self.resolve(n, g) for n, g in zip(prompt_lens, gen_lens)))

    @property
    def per_block(self) -> bool:
        """The FlexGen port's ratio semantics: a block's budget from its padded length (--h2o-variant port)."""
        return trait(self.policy, "per_block")

    def _heavy_recent(self, prompt_len: int) -> tuple[int, int]:
        heavy_given = self.hh_size is not None or self.hh_ratio is not None
        if self.hh_size is not None:
            heavy = self.hh_size
        elif self.hh_ratio is not None:
            heavy = int(self.hh_ratio * prompt_len)      # int() truncates, as the port does
        else:
            heavy = 0
        if self.recent_size is not None:
            recent = self.recent_size
        elif self.recent_ratio is not None:
            recent = int(self.recent_ratio * prompt_len)
        elif heavy_given:
            # the port keeps hh_k - 1 recent rows (+ the current one); elsewhere recent mirrors heavy
            recent = max(heavy - 1, 0) if self.per_block else heavy     # the port's default window
        else:
            recent = 0
        return heavy, recent

    def describe_request(self) -> str:
        parts = [f"{n}={getattr(self, n)}" for n in ("hh_ratio", "recent_ratio", "hh_size", "recent_size",
                                                     "sink_size", "kv_budget", "score_window", "pool_kernel")
                 if getattr(self, n) is not None]
        if self.head_budgets != "uniform":
            parts.append(f"head_budgets={self.head_budgets} (floor {self.head_floor:g})")
        return f"policy={self.policy}" + (", " + ", ".join(parts) if parts else "")

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        """A seeded generator for the random policy (None for the deterministic ones)."""
        return torch.Generator(device=device).manual_seed(self.seed) if self.policy == "random" else None


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def describe(budget: Budget, prompt_len: int, gen_len: int, kv_bytes_per_token: float) -> str:
    """One startup line with the real slot counts, the share of prompt_len + gen_len, and the KV bytes.

    kv_bytes_per_token: bytes one token's slot costs across whatever the caller counts (layers, batch); the
    evicting cache is charged for its allocated capacity (budget + the current-token slot)."""
    total = prompt_len + gen_len
    full_bytes = _fmt_bytes(total * kv_bytes_per_token)
    if budget.policy == "full":
        return f"KV cache: full, {total} slots/seq ({prompt_len}+{gen_len}); {full_bytes}"
    parts = [f"{n} {what}" for n, what in ((budget.sink, "sink"), (budget.heavy, "heavy"),
                                           (budget.recent, "recent")) if n]
    pct = 100.0 * budget.budget / max(total, 1)
    line = (f"KV cache: {budget.policy}, {budget.budget} slots/seq ({' + '.join(parts)}) = {pct:.1f}% of "
            f"{prompt_len}+{gen_len}; "
            f"{_fmt_bytes(budget.capacity * kv_bytes_per_token)} instead of {full_bytes}")
    if not budget.evicts:
        line += " (budget covers the whole run: nothing is evicted)"
    return line + scoring_note(budget)


def scoring_note(budget: Budget) -> str:
    """How a scoring policy ranks keys, when it is not H2O's every-query sum: '' for the others."""
    if budget.policy == "full":
        return ""
    heads = ("" if budget.head_floor is None else
             f"; head budgets adaptive (a layer's KV heads share its slots by score, each keeping at least "
             f"{budget.head_floor:.0%} of its own)")
    if budget.score_window is None:
        return heads
    w = budget.score_window
    queries = "the last prompt query" if w == 1 else f"the last {w} prompt queries"
    pooled = f", averaged over {budget.pool_kernel} neighbouring keys" if budget.pool_kernel > 1 else ""
    if trait(budget.policy, "step_scores"):
        then = "each step then evicts the key the newest query attends to least (the layer's heads averaged)"
    else:
        then = "decode then evicts as exact H2O on the summed attention"
    return f"; prompt keys ranked by {queries}{pooled}; {then}{heads}"


def _span(values: Sequence[float], fmt: str = "{:g}") -> str:
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def describe_rows(budgets: Sequence[Budget], prompt_lens: Sequence[int], gen_lens: Sequence[int],
                  kv_bytes_per_token: float) -> str:
    """describe() for a job of many prompts, each with its own budget: the range of slots per sequence
    (`KV cache: h2o, 21-102 slots/seq ...`), and the bytes of the largest allocation. One line either way."""
    if len({(b, n, g) for b, n, g in zip(budgets, prompt_lens, gen_lens)}) == 1:
        return describe(budgets[0], prompt_lens[0], gen_lens[0], kv_bytes_per_token)
    totals = [n + g for n, g in zip(prompt_lens, gen_lens)]
    full_bytes = _fmt_bytes(max(totals) * kv_bytes_per_token)
    if budgets[0].policy == "full":
        return f"KV cache: full, {_span(totals)} slots/seq (prompt + new tokens); up to {full_bytes}"
    parts = [f"{_span(vals)} {what}" for vals, what in (([b.sink for b in budgets], "sink"),
                                                        ([b.heavy for b in budgets], "heavy"),
                                                        ([b.recent for b in budgets], "recent")) if max(vals)]
    pct = [100.0 * b.budget / max(t, 1) for b, t in zip(budgets, totals)]
    cap = max(b.capacity for b in budgets)
    per = "the block's longest prompt" if trait(budgets[0].policy, "per_block") else "each prompt's own length"
    line = (f"KV cache: {budgets[0].policy}, {_span([b.budget for b in budgets])} slots/seq "
            f"({' + '.join(parts)}; from {per}) = {_span(pct, '{:.1f}')}% of prompt + new tokens; "
            f"up to {_fmt_bytes(cap * kv_bytes_per_token)} instead of {full_bytes}")
    if not any(b.evicts for b in budgets):
        line += " (the budgets cover the whole run: nothing is evicted)"
    return line + scoring_note(budgets[0])
