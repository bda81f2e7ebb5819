"""KV eviction: budgets (EvictionConfig -> Budget), stateless policies, and (cache.py) the slot storage.

Names load on first use (PEP 562), so the CLI can read the policy registry (kv/registry.py, torch-free) without
importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "budget": ("Budget", "EvictionConfig", "RowBudgets", "describe", "describe_rows"),
    "policy": ("EvictionPolicy", "policy_for"),
    "registry": ("PolicySpec", "cli_policies", "cli_variants", "get_policy", "policy_names", "spec", "trait"),
    "select": ("NO_VICTIM", "pack_kept"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
