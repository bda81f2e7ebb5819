"""KV eviction: budgets (EvictionConfig -> Budget), stateless policies, and (cache.py) the slot storage."""
from __future__ import annotations

from flexgen_h2o.kv.budget import POLICY_NAMES, Budget, EvictionConfig, RowBudgets, describe, describe_rows
from flexgen_h2o.kv.policy import EvictionPolicy, get_policy, policy_for
from flexgen_h2o.kv.select import NO_VICTIM, pack_kept

__all__ = ["POLICY_NAMES", "Budget", "EvictionConfig", "RowBudgets", "describe", "describe_rows", "EvictionPolicy",
           "get_policy", "policy_for",
           "NO_VICTIM", "pack_kept"]
