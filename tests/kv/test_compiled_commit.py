"""The compiled commit (kernels/csrc/commit_step.cpp, KVCache._compiled_commit) against KVCache's torch-op commit,
which runs kv/h2o.py's rules: the same cache bytes, positions, scores and victims after every step, on columns
built to hit the rules' corners (ties, sinks, gaps in the recent window, columns within their budget)."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.kv import Budget, get_policy
from flexgen_h2o.kv import policy_names, trait
from flexgen_h2o.kv.cache import KVCache
from flexgen_h2o.models.layer import KVSpec, KVView, LayerOutput
from flexgen_h2o.models.ops import TORCH

B, G, CAP, D = 7, 3, 24, 16


def _column_state(seed: int, newest: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (unique per column, -1 = free, one free slot at least) and scores with many exact ties."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.full((B, G, CAP), -1, dtype=torch.int32)
    for b in range(B):
        for g in range(G):
            n = int(torch.randint(CAP // 2, CAP, (1,), generator=gen))          # leaves >= 1 free slot
            if (b + g) % 3 == 0:   # consecutive newest positions, as a cache's recent window has them
                chosen = torch.cat([torch.randperm(newest - 12, generator=gen)[:n - 10], torch.arange(newest - 10,
                                                                                                   newest)])
            else:                  # scattered: the window's shortcut fails and the exact order decides
                chosen = torch.randperm(newest, generator=gen)[:n]
            slots = torch.randperm(CAP, generator=gen)[:n]
            pos[b, g, slots] = chosen.to(torch.int32)
    scores = torch.randint(0, 4, (B, G, CAP), generator=gen).float() / 4          # quarters: ties everywhere
    return pos, scores.masked_fill(pos < 0, 0.0)


def _cache(policy: str, budget: Budget, pos: torch.Tensor, scores: torch.Tensor, kv_dtype, kernels) -> KVCache:
    """kernels: a kernels.Kernels with the compiled build (the engine's), or ops.TORCH."""
    cache = KVCache(KVSpec(G, D), B, CAP, get_policy(policy), budget, dtype=kv_dtype, kernels=kernels)
    gen = torch.Generator().manual_seed(3)
    cache.k.copy_(torch.randn(B, G, CAP, D, generator=gen))
    cache.v.copy_(torch.randn(B, G, CAP, D, generator=gen))
    cache.pos.copy_(pos)
    cache.score.copy_(scores)
    cache.n_used = CAP
    return cache


def _step(cache: KVCache, seed: int, with_mass: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    slot = cache.free_slots()
    view = KVView(k=cache.k, v=cache.v, valid=cache.pos >= 0, write_slot=slot)
    # quarters, as the scores: sums keep tying, so the tie rule (the smaller position goes) decides victims
    mass = (torch.randint(0, 4, (B, G, CAP), generator=gen) / 4).masked_fill(cache.pos < 0, 0.0) if with_mass else None
    if mass is not None:
        mass.scatter_(2, slot.unsqueeze(-1), 0.25)                 # the new token attends to itself
    out = LayerOutput(hidden=None, k_new=torch.randn(B, G, 1, D, generator=gen),
                      v_new=torch.randn(B, G, 1, D, generator=gen), scores=mass)
    newest = int(cache.pos.max())
    cache.commit_decode(view, out, torch.arange(B) + newest + 1)


@pytest.mark.parametrize("policy", sorted(n for n in policy_names() if trait(n, "compiled_rule") is not None))
@pytest.mark.parametrize("sink, heavy, recent", [(0, 6, 6), (2, 5, 3), (0, 0, 10), (0, 11, 0), (3, 4, 40),
                                                 (0, 30, 2)])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
def test_compiled_commit_leaves_the_cache_the_torch_ops_leave(kernel, monkeypatch, policy, sink, heavy, recent,
                                                               kv_dtype):
    budget = Budget(sink, heavy, recent, policy=policy)
    pos, scores = _column_state(seed=heavy * 100 + recent + sink)
    compiled = _cache(policy, budget, pos, scores, kv_dtype, kernel)
    plain = _cache(policy, budget, pos, scores, kv_dtype, kernel)
    assert compiled._compiled_commit()
    evicting = 0
    for step in range(6):                     # later steps start from states the earlier choices made
        before = int((compiled.pos >= 0).sum())
        _step(compiled, seed=step, with_mass=policy != "full")
        monkeypatch.setattr(KVCache, "_compiled_commit", lambda self: False)
        _step(plain, seed=step, with_mass=policy != "full")
        monkeypatch.undo()
        evicting += before + B * G - int((compiled.pos >= 0).sum())
        for name in ("pos", "score", "k", "v"):
            assert torch.equal(getattr(compiled, name), getattr(plain, name)), (name, step)
    if policy != "full" and heavy + recent + sink < CAP // 2:
        assert evicting > 0                   # the corners above really evict


def test_unknown_rules_and_gpu_caches_keep_the_torch_ops(kernel):
    budget = Budget(0, 4, 4)
    pos, scores = _column_state(seed=1)
    for policy in ("random", "local", "sink"):
        assert not _cache(policy, budget, pos, scores, torch.float16, kernel)._compiled_commit()
    assert not _cache("h2o", budget, pos, scores, torch.bfloat16, kernel)._compiled_commit()
    assert not _cache("h2o", budget, pos, scores, torch.float16, TORCH)._compiled_commit()   # no compiled build


def test_bad_windows_are_refused_by_name(kernel):
    cache = _cache("h2o", Budget(0, 4, 4), *_column_state(seed=2), torch.float16, kernel)
    slot = torch.zeros(B, G, dtype=torch.long)
    row = torch.zeros(B, G, 1, D)
    with pytest.raises(RuntimeError, match="window"):
        kernel.ext.commit_step(cache.k, cache.v, cache.score, cache.pos, slot, row, row, torch.arange(B),
                               torch.empty(0), CAP + 1, 1, 0, torch.full((B,), 4), torch.full((B,), 8))
    with pytest.raises(RuntimeError, match="write slot"):
        kernel.ext.commit_step(cache.k, cache.v, cache.score, cache.pos, slot + 5, row, row, torch.arange(B),
                               torch.empty(0), 5, 1, 0, torch.full((B,), 4), torch.full((B,), 8))
