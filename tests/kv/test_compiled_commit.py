"""The compiled commit (kernels/csrc/commit_step.cpp, KVCache._compiled_commit) against KVCache's torch-op commit,
which runs kv/h2o.py's rules: the same cache bytes, positions, scores and victims after every step, on columns
built to hit the rules' corners (ties, sinks, gaps in the recent window, columns within their budget)."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.kv import Budget
from flexgen_h2o.kv import policy_names, trait
from flexgen_h2o.kv.cache import KVCache
from flexgen_h2o.models.ops import TORCH
from tests.kernel_inputs import B, CAP, D, G, column_state, commit_cache, commit_step


@pytest.mark.parametrize("policy", sorted(n for n in policy_names() if trait(n, "compiled_rule") is not None))
@pytest.mark.parametrize("sink, heavy, recent", [(0, 6, 6), (2, 5, 3), (0, 0, 10), (0, 11, 0), (3, 4, 40),
                                                 (0, 30, 2)])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
def test_compiled_commit_leaves_the_cache_the_torch_ops_leave(kernel, monkeypatch, policy, sink, heavy, recent,
                                                               kv_dtype):
    budget = Budget(sink, heavy, recent, policy=policy)
    pos, scores = column_state(seed=heavy * 100 + recent + sink)
    if policy == "tova":      # one decision per layer: every KV head of a sequence holds the same tokens slot by slot
        pos = pos[:, :1].expand_as(pos).clone()
        scores = scores.masked_fill(pos < 0, 0.0)
    compiled = commit_cache(policy, budget, pos, scores, kv_dtype, kernel)
    plain = commit_cache(policy, budget, pos, scores, kv_dtype, kernel)
    assert compiled._compiled_commit()
    evicting = 0
    for step in range(6):                     # later steps start from states the earlier choices made
        before = int((compiled.pos >= 0).sum())
        commit_step(compiled, seed=step, with_mass=policy != "full")
        monkeypatch.setattr(KVCache, "_compiled_commit", lambda self: False)
        commit_step(plain, seed=step, with_mass=policy != "full")
        monkeypatch.undo()
        evicting += before + B * G - int((compiled.pos >= 0).sum())
        for name in ("pos", "score", "k", "v"):
            assert torch.equal(getattr(compiled, name), getattr(plain, name)), (name, step)
    if policy != "full" and heavy + recent + sink < CAP // 2:
        assert evicting > 0                   # the corners above really evict


def test_unknown_rules_and_gpu_caches_keep_the_torch_ops(kernel):
    budget = Budget(0, 4, 4)
    pos, scores = column_state(seed=1)
    for policy in ("random", "local", "sink"):
        assert not commit_cache(policy, budget, pos, scores, torch.float16, kernel)._compiled_commit()
    assert not commit_cache("h2o", budget, pos, scores, torch.bfloat16, kernel)._compiled_commit()
    assert not commit_cache("h2o", budget, pos, scores, torch.float16, TORCH)._compiled_commit()   # no compiled build


def test_bad_windows_are_refused_by_name(kernel):
    cache = commit_cache("h2o", Budget(0, 4, 4), *column_state(seed=2), torch.float16, kernel)
    slot = torch.zeros(B, G, dtype=torch.long)
    row = torch.zeros(B, G, 1, D)
    with pytest.raises(RuntimeError, match="window"):
        kernel.ext.commit_step(cache.k, cache.v, cache.score, cache.pos, slot, row, row, torch.arange(B),
                               torch.empty(0), CAP + 1, 1, 0, torch.full((B,), 4), torch.full((B,), 8))
    with pytest.raises(RuntimeError, match="write slot"):
        kernel.ext.commit_step(cache.k, cache.v, cache.score, cache.pos, slot + 5, row, row, torch.arange(B),
                               torch.empty(0), 5, 1, 0, torch.full((B,), 4), torch.full((B,), 8))


def test_the_layer_rule_refuses_heads_that_hold_other_tokens(kernel):
    """tova's compiled commit sums a slot's mass over the KV heads, which is only the same token's if every
    head holds the same tokens slot by slot (kv/tova.py): columns that differ are refused, not mis-summed."""
    pos, scores = column_state(seed=4)
    cache = commit_cache("tova", Budget(0, 4, 1, policy="tova"), pos, scores, torch.float16, kernel)
    with pytest.raises(RuntimeError, match="same tokens slot by slot"):
        commit_step(cache, seed=0, with_mass=True)
