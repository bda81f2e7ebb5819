"""KV windows staged on a CPU reuse pooled buffers: allocations stop growing with the number of decode steps, and
the output is the same as with a fresh copy per step. A cache that is one RAM-homed part without rolling hands
out its own fp16 window instead (tests/kv/test_narrow_window.py), so the staged cases here are a split across
two tiers and a rolling cache."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kv.staging import StagingBuffers
from tests.helpers import greedy, make_engine, max_logit_diff, random_prompts, tiny_hf

H2O = EvictionConfig(policy="h2o", hh_size=4, recent_size=3)
ROLLING = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, position_rolling=True)


def test_buffers_come_back_and_are_reused():
    pool = StagingBuffers()
    a = pool.take(12, torch.float32)
    pool.give(a)
    assert pool.take(12, torch.float32).data_ptr() == a.data_ptr()
    assert pool.take(12, torch.float32).data_ptr() != a.data_ptr()      # lent out: a second one is new
    assert pool.take(12, torch.float64).dtype == torch.float64


@pytest.mark.parametrize("cache_percent, eviction", [((50, 50), H2O), ((100, 0), ROLLING)])
def test_allocations_do_not_grow_with_steps_and_output_is_unchanged(monkeypatch, cache_percent, eviction):
    misses, hits = [], []
    take = StagingBuffers.take

    def counting_take(self, numel, dtype):
        (hits if self._free.get((numel, dtype)) else misses).append(numel)
        return take(self, numel, dtype)

    monkeypatch.setattr(StagingBuffers, "take", counting_take)
    model = tiny_hf("llama-gqa")
    prompts = random_prompts([24, 13])
    offload = OffloadPolicy.from_percent([100, 0, *cache_percent, 100, 0], gpu_batch_size=2)
    allocated = []
    for n_new in (8, 40):
        misses.clear()
        hits.clear()
        engine = make_engine(model, eviction=eviction, offload=offload)
        pooled = engine.generate(prompts, greedy(n_new))
        allocated.append(len(misses))
        assert len(hits) > len(misses)                               # most windows reuse a buffer
    assert allocated[0] == allocated[1]                              # 5x the steps, no new buffers
    plain = make_engine(model, eviction=eviction, offload=offload)
    plain.kv_staging = None                                          # a fresh copy per (layer, step)
    ref = plain.generate(prompts, greedy(40))
    assert pooled.token_ids == ref.token_ids
    assert all(max_logit_diff(engine.step_logits[i], plain.step_logits[i]) == 0.0 for i in range(len(prompts)))
