"""KVCache.commit_prefill's slice path (an unpadded prompt under a rule that keeps every row) against its general
path (keep mask, packing, gather): the same cache bytes, scores, positions and fill, chunk by chunk."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.kv import Budget, get_policy
from flexgen_h2o.kv.cache import KVCache
from flexgen_h2o.models.layer import KVSpec

B, G, P, D, CAP = 5, 2, 11, 8, 16


def _prompt(seed: int):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, G, P, D, generator=gen), torch.randn(B, G, P, D, generator=gen)
    scores = torch.rand(B, G, P, generator=gen)
    return k, v, scores, torch.arange(P).repeat(B, 1)


@pytest.mark.parametrize("with_scores", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
def test_slice_path_writes_what_the_general_path_writes(with_scores, kv_dtype):
    budget = Budget(sink=0, heavy=0, recent=CAP - 1, policy="full")
    k, v, scores, pos = _prompt(0)
    caches = []
    for unpadded in (True, False):
        cache = KVCache(KVSpec(G, D), B, CAP, get_policy("full"), budget, dtype=kv_dtype)
        cache.score.fill_(7.0)                   # stale values: both paths must overwrite the prompt's slots
        for lo, hi in ((0, 2), (2, B)):          # committed in two chunks, as a chunked prefill does
            cache.commit_prefill(k[lo:hi], v[lo:hi], scores[lo:hi] if with_scores else None, pos[lo:hi],
                                 first_row=lo, unpadded=unpadded)
        caches.append(cache)
    fast, general = caches
    for name in ("k", "v", "score", "pos"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert fast.n_used == general.n_used == P and fast.bytes_written == general.bytes_written
    assert torch.equal(fast.k[:, :, :P], k.to(kv_dtype)) and (fast.pos[:, :, P:] == -1).all()


def test_slice_path_is_only_for_rules_that_keep_every_row():
    """h2o at a budget below the prompt drops rows even without pads: the flag must not bypass its choice."""
    budget = Budget(sink=0, heavy=3, recent=3)
    k, v, scores, pos = _prompt(1)
    cache = KVCache(KVSpec(G, D), B, CAP, get_policy("h2o"), budget, dtype=torch.float32)
    cache.commit_prefill(k, v, scores, pos, unpadded=True)
    assert cache.n_used == 6 and ((cache.pos >= 0).sum(-1) == 6).all()


def test_slice_path_refuses_a_prompt_longer_than_the_cache():
    budget = Budget(sink=0, heavy=0, recent=CAP - 1, policy="full")
    cache = KVCache(KVSpec(G, D), B, P, get_policy("full"), budget, dtype=torch.float32)   # P - 1 rows fit
    k, v, _, pos = _prompt(2)
    with pytest.raises(RuntimeError, match="kept 11 prompt rows but the cache has 10"):
        cache.commit_prefill(k, v, None, pos, unpadded=True)


def test_free_slots_is_the_lowest_free_slot_of_each_column():
    """Columns with several free slots (evictions leave holes anywhere), a kept position 0, and a column whose
    only free slot is the last: always the first slot holding -1."""
    budget = Budget(sink=0, heavy=0, recent=CAP - 1, policy="full")
    cache = KVCache(KVSpec(G, D), B, CAP, get_policy("full"), budget, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    cache.pos.copy_(torch.randperm(B * G * CAP, generator=gen).view(B, G, CAP).int())
    holes = {(0, 0): [3, 9, 12], (1, 1): [0, 5], (2, 0): [CAP - 1], (4, 1): [7, 2]}
    for b in range(B):
        for g in range(G):
            for slot in holes.get((b, g), [(b * 5 + g * 3) % CAP, CAP - 2]):
                cache.pos[b, g, slot] = -1
    want = torch.tensor([[min(holes.get((b, g), [(b * 5 + g * 3) % CAP, CAP - 2])) for g in range(G)]
                         for b in range(B)])
    assert torch.equal(cache.free_slots(), want)
