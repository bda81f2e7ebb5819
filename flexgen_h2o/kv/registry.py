"""The eviction policies by name, declared once. Budgets, the cache, the CLI's choices and the accuracy harness's
grid read a policy's traits from its spec here; its decisions live in the class `impl` names, imported on first
use. A new rule is its own module plus one PolicySpec line below, not a name added to five lists.

Torch-free on purpose: the CLI lists `--policy` choices from here and must refuse bad flags before torch loads.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


# AdaKV's safeguard: under head-adaptive budgets each head keeps at least this share of its uniform budget (the
# paper's and kvpress's 0.2)
DEFAULT_HEAD_FLOOR = 0.2


@dataclass(frozen=True)
class PolicySpec:
    name: str
    impl: str                              # "module:Class" in flexgen_h2o.kv
    needs_scores: bool = False             # ranks tokens by accumulated attention: attention returns key mass
    window_only: bool = False              # no heavy-hitter share: the budget beyond the sinks is the window
    default_sinks: int = 0                 # first tokens kept when the user gives no --sink-size
    per_block: bool = False                # one budget per block, from its padded length (the FlexGen port)
    min_heavy: int = 0                     # heavy hitters the rule needs at least
    compiled_rule: int | None = None       # the compiled commit's rule number (kernels/csrc/commit_step.cpp)
    keeps_every_row: bool = False          # keeps every prompt row: an unpadded prompt is written as slices
    # ranks by mass per query that saw the key, a count taken from positions: every prompt query must have scored
    # (so no EvictionConfig.score_window)
    counts_every_query: bool = False
    variant_of: str | None = None          # chosen on the CLI as `--policy <variant_of> --h2o-variant <variant>`
    variant: str | None = None
    # the prompt queries that rank the keys when the user gives no --score-window (SnapKV's observation window,
    # TOVA's last query); None: every real query
    default_score_window: int | None = None
    default_pool_kernel: int | None = None  # prompt scores averaged over this many neighbouring keys (SnapKV)
    recent_is_score_window: bool = False    # the recent share is the score window, the rest heavy (unless given)
    step_scores: bool = False               # a slot's score is the last step's attention, not the sum (TOVA)
    # takes --head-budgets adaptive: ranks keys per head by comparable scores and evicts each head on its own
    head_adaptive: bool = False
    summary: str = ""                       # what it keeps: the startup line and `--policy` help


SPECS: tuple[PolicySpec, ...] = (
    PolicySpec("full", "window:FullPolicy", compiled_rule=0, keeps_every_row=True, summary="every token"),
    PolicySpec("h2o", "h2o:H2OPolicy", needs_scores=True, compiled_rule=1, head_adaptive=True,
               summary="heavy hitters by attention summed over every query, plus the recent window"),
    # the port asserts int(prompt_len * hh_ratio) > 0
    PolicySpec("h2o-port", "h2o:H2OPortPolicy", needs_scores=True, per_block=True, min_heavy=1, compiled_rule=3,
               variant_of="h2o", variant="port", summary="the FlexGen port's H2O: the leaving token always enters"),
    PolicySpec("h2o-avg", "h2o:H2OAveragePolicy", needs_scores=True, compiled_rule=2, variant_of="h2o",
               variant="avg", counts_every_query=True, head_adaptive=True,
               summary="H2O ranking by attention per query that saw the key (no bias to old keys)"),
    PolicySpec("local", "window:WindowPolicy", window_only=True, summary="the newest tokens only"),
    PolicySpec("sink", "window:SinkPolicy", window_only=True, default_sinks=4,      # StreamingLLM's start_size
               summary="4 first tokens plus the newest"),
    PolicySpec("random", "h2o:RandomPolicy", summary="random heavy hitters plus the recent window (a floor)"),
    # the SnapKV paper's 32-query window, and pooling over 31 keys, about a sentence around each hit (kvpress's
    # 64 and 5 lose needles: docs/accuracy.md "Question-aware eviction")
    PolicySpec("snapkv", "snapkv:SnapKVPolicy", needs_scores=True, compiled_rule=1, default_score_window=32,
               default_pool_kernel=31, recent_is_score_window=True, head_adaptive=True,
               summary="prompt keys the question (the last queries) attends to, pooled over neighbours, plus the "
                       "question; then H2O on the summed attention"),
    PolicySpec("tova", "tova:TOVAPolicy", needs_scores=True, compiled_rule=4, default_score_window=1,
               recent_is_score_window=True, step_scores=True,
               summary="the keys the newest query attends to most, averaged over the layer's heads; no history"),
)
_BY_NAME = {s.name: s for s in SPECS}
_INSTANCES: dict[str, Any] = {}


def policy_names() -> tuple[str, ...]:
    return tuple(_BY_NAME)


def spec(name: str) -> PolicySpec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(_BY_NAME)}") from None


def trait(name: str, what: str) -> Any:
    return getattr(spec(name), what)


def get_policy(name: str) -> Any:
    """The policy object (stateless, one per name): its decision methods plus `name`, `needs_scores` and
    `compiled_rule` from its spec."""
    if name not in _INSTANCES:
        s = spec(name)
        module, cls = s.impl.split(":")
        obj = getattr(importlib.import_module(f"flexgen_h2o.kv.{module}"), cls)()
        obj.name, obj.needs_scores, obj.compiled_rule = s.name, s.needs_scores, s.compiled_rule
        _INSTANCES[name] = obj
    return _INSTANCES[name]


def cli_policies() -> tuple[str, ...]:
    """`--policy` choices: every evicting policy that is not a variant of another."""
    return tuple(s.name for s in SPECS if s.name != "full" and s.variant_of is None)


def policy_help() -> str:
    """What each `--policy` choice keeps, one clause each (its spec's summary)."""
    return "; ".join(f"{s.name}: {s.summary}" for s in SPECS if s.name in cli_policies())


def cli_variants(base: str) -> dict[str, str]:
    """`--h2o-variant` spellings of `base`'s variants -> policy names."""
    return {s.variant: s.name for s in SPECS if s.variant_of == base}
