"""The grid every task runs: eviction policies x KV budgets, each point turned into the engine's EvictionConfig.

A budget is either a share of the sequence ("20%": of prompt + new tokens, resolved per block because the
engine gives every sequence of a block the same slot count) or an absolute slot count ("256", seed 000's
"KV cache size"). Every evicting policy gets the same total through `kv_budget`, so the policies compete at
exactly equal cache sizes (sinks, heavy hitters and recent window all come out of that total).
"""
from __future__ import annotations

from dataclasses import dataclass

from flexgen_h2o.config import ConfigError
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kv.page_rule import DEFAULT_PAGE_SIZE, PageRule
from flexgen_h2o.kv import policy_names, trait

DEFAULT_POLICIES = policy_names()                     # every registered rule: full, h2o, h2o-port, h2o-avg, ...
DEFAULT_BUDGETS = ("5%", "10%", "20%", "40%", "64", "128", "256", "512", "1024")
# kvpress's presses as extra rows (eval/peers.py), named only when asked for: they run outside the engine
PEER_PREFIX = "kvpress-"
PEER_POLICIES = tuple(PEER_PREFIX + p for p in ("snapkv", "tova", "adakv", "observed"))


def is_peer(policy: str) -> bool:
    """Whether a grid row is one of kvpress's presses rather than an eviction policy of the engine."""
    return policy in PEER_POLICIES


@dataclass(frozen=True)
class BudgetSpec:
    """One budget of the grid: a fraction of the sequence, or a slot count."""
    label: str
    fraction: float | None = None
    slots: int | None = None

    @property
    def is_fraction(self) -> bool:
        return self.fraction is not None

    def slots_for(self, seq_len: int) -> int:
        """Total KV slots per (sequence, KV head) for a block whose longest sequence has seq_len tokens."""
        if self.fraction is not None:
            return max(1, int(round(self.fraction * seq_len)))
        assert self.slots is not None
        return self.slots


def parse_budget(text: str) -> BudgetSpec:
    """'20%' -> 20 % of the sequence; '256' -> 256 slots. Raises ConfigError with what is accepted."""
    t = text.strip()
    try:
        number = float(t[:-1]) if t.endswith("%") else int(t)
    except ValueError:
        raise ConfigError(f"budget {text!r} is neither a percentage like 20% nor a slot count like 256") from None
    if t.endswith("%"):
        if not 0 < number <= 100:
            raise ConfigError(f"budget {text!r}: a percentage must be in (0, 100]")
        return BudgetSpec(label=f"{number:g}%", fraction=number / 100.0)
    slots = int(number)
    if slots < 1:
        raise ConfigError(f"budget {text!r}: a slot count must be >= 1")
    return BudgetSpec(label=str(slots), slots=slots)


def parse_budgets(text: str) -> list[BudgetSpec]:
    specs = [parse_budget(t) for t in text.split(",") if t.strip()]
    if not specs:
        raise ConfigError("--budgets is empty; give e.g. 5%,10%,20%,40%,64,128,256,512,1024")
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--budgets repeats a budget: {','.join(labels)}")
    return specs


ADAPTIVE_SUFFIX = "-adaptive"       # `snapkv-adaptive`: the rule with head-adaptive budgets (--head-budgets adaptive)


# page selection over a full cache (--kv-select pages): rows at the same budgets, read rather than kept, each
# with its page score and whether it chooses a layer ahead (kv/page_rule.py)
PAGES = {"pages": dict(score="keys"), "pages-bound": dict(score="bound"), "pages-ahead": dict(score="keys", ahead=True)}


def base_policy(name: str) -> tuple[str, bool]:
    """A grid policy name as (the engine's policy, whether its heads share their budget)."""
    if name.endswith(ADAPTIVE_SUFFIX) and name[:-len(ADAPTIVE_SUFFIX)] in policy_names():
        return name[:-len(ADAPTIVE_SUFFIX)], True
    return name, False


def parse_policies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    adaptive = [n + ADAPTIVE_SUFFIX for n in policy_names() if trait(n, "head_adaptive")]
    bad = [n for n in names if n not in policy_names() and not is_peer(n) and n not in adaptive and n not in PAGES]
    if bad or not names:
        raise ConfigError(f"unknown policy {', '.join(bad) or '(none given)'}; choose from "
                          f"{', '.join(policy_names() + PEER_POLICIES + tuple(adaptive) + tuple(PAGES))}")
    if len(set(names)) != len(names):
        raise ConfigError(f"--policies repeats a policy: {','.join(names)}")
    return names


@dataclass(frozen=True)
class GridPoint:
    """One run configuration: a policy, its budget (None for full) and whether positions roll."""
    policy: str
    budget: BudgetSpec | None = None
    rolling: bool = False
    # h2o / h2o-port: the heavy hitters' share of the slots, the rest recent; None: kv_budget's own even split
    heavy_share: float | None = None

    @property
    def key(self) -> str:
        """Stable name used in the checkpoint JSON and the tables, e.g. 'h2o@20%' or 'sink@512+roll'."""
        base = self.policy if self.budget is None else f"{self.policy}@{self.budget.label}"
        return base + ("+roll" if self.rolling else "")

    def slots(self, seq_len: int) -> int | None:
        """The total slots this point asks for in a block of seq_len tokens (None: full cache)."""
        if self.budget is None:
            return None
        if is_peer(self.policy):          # a press keeps this many prompt tokens per KV head
            return self.budget.slots_for(seq_len)
        # sink needs room for its 4 sinks plus one window slot; smaller requests are raised (and recorded)
        if self.policy in PAGES:
            return self.budget.slots_for(seq_len)
        return max(self.budget.slots_for(seq_len), trait(base_policy(self.policy)[0], "default_sinks") + 1)

    def eviction(self, seq_len: int, seed: int = 0) -> EvictionConfig:
        if is_peer(self.policy):
            raise ConfigError(f"{self.policy} is a kvpress row: it runs in kvpress's pipeline, not the engine")
        slots = self.slots(seq_len)
        if slots is None:
            return EvictionConfig(policy="full", position_rolling=self.rolling)
        if self.policy in PAGES:         # a share reads that share of each sequence; a slot count, its pages
            read = (dict(fetch_ratio=self.budget.fraction) if self.budget.is_fraction
                    else dict(fetch_pages=-(-slots // DEFAULT_PAGE_SIZE)))
            return EvictionConfig(policy="full", pages=PageRule(**PAGES[self.policy], **read))
        policy, adaptive = base_policy(self.policy)
        rule = dict(policy=policy, position_rolling=self.rolling, seed=seed,
                    head_budgets="adaptive" if adaptive else "uniform")
        if trait(policy, "needs_scores") and self.heavy_share is not None:
            heavy = int(round(self.heavy_share * slots))
            return EvictionConfig(hh_size=heavy, recent_size=slots - heavy, **rule)
        return EvictionConfig(kv_budget=slots, **rule)


def make_grid(policies: list[str], budgets: list[BudgetSpec], rolling: bool = False,
              heavy_share: float | None = None) -> list[GridPoint]:
    """full first (other tasks compare against its output), then every evicting policy at every budget."""
    points = [GridPoint("full", None, rolling)] if "full" in policies else []
    for policy in policies:
        if policy != "full":
            share = None if is_peer(policy) else heavy_share
            points += [GridPoint(policy, b, rolling, share) for b in budgets]
    return points


def parse_heavy_share(value: float | None) -> float | None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ConfigError(f"--heavy-share {value} is a fraction of each H2O budget in [0, 1] (unset: an even split)")
    return value
