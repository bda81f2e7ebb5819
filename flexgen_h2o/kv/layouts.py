"""The cache class a block's KV plan needs, chosen once where the caches are made (schedule/block.py, hf/cache.py)."""
from __future__ import annotations

from flexgen_h2o.kv.budget import Budget, RowBudgets
from flexgen_h2o.kv.cache import KVCache
from flexgen_h2o.kv.page_rule import PageRule
from flexgen_h2o.kv.pages import PagedKVCache
from flexgen_h2o.kv.ragged import RaggedKVCache


def kv_cache(spec, batch: int, capacity: int, policy, budget: Budget | RowBudgets, *, pages: PageRule | None = None,
             summaries: dict | None = None, **kw) -> KVCache:
    """Ragged where a layer's heads share their slots and the policy evicts; paged where a step reads only the
    pages its query needs (summaries: PagedKVCache's summary_device and summary_dtype); else the uniform slots."""
    if pages is not None:
        return PagedKVCache(spec, batch, capacity, policy, budget, pages=pages, **(summaries or {}), **kw)
    if budget.head_floor is not None and policy.name != "full":
        return RaggedKVCache(spec, batch, capacity, policy, budget, **kw)
    return KVCache(spec, batch, capacity, policy, budget, **kw)
