"""A RAM-homed fp16 cache on a CPU hands decode attention its own window (KVView.compute_dtype), which
ops.narrow_decode_attention upcasts a block of sequences at a time instead of upcasting the whole window first.
Both must give exactly what the upcast copy gives. (Where the compiled kernel is built it takes these steps
instead: tests/test_fused_attention.py holds it to this path.)"""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kernels import build
from flexgen_h2o.models import ops
from tests.helpers import (count_in_place_attention, engine_kept, greedy, make_engine, max_logit_diff,
                           random_prompts, tiny_hf)


def _window(b: int, g: int, s: int, d: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 K and V windows as a cache hands them out: the first s of `capacity` slots, so not contiguous."""
    k = torch.randn(b, g, capacity, d).half()
    v = torch.randn(b, g, capacity, d).half()
    return k[:, :, :s], v[:, :, :s]


@pytest.mark.parametrize("rows_per_block", [1, 2, 5])
@pytest.mark.parametrize("score_reduce", ["sum", "mean"])
def test_narrow_attention_equals_attention_over_the_upcast_copy(monkeypatch, rows_per_block, score_reduce):
    torch.manual_seed(0)
    b, h, g, s, d = 5, 6, 2, 11, 8
    k16, v16 = _window(b, g, s, d, capacity=13)
    k_before, v_before = k16.clone(), v16.clone()
    q = torch.randn(b, h, 1, d)
    k_new, v_new = torch.randn(b, g, 1, d), torch.randn(b, g, 1, d)
    slot = torch.randint(0, s, (b, g))
    valid = torch.rand(b, g, s) > 0.3
    valid.scatter_(2, slot.unsqueeze(-1), True)
    # the staged path: upcast the whole window, write the new rows into it, attend
    k32, v32 = k16.float(), v16.float()
    ops.write_slot(k32, slot, k_new)
    ops.write_slot(v32, slot, v_new)
    ref_out, ref_scores = ops.grouped_attention(q, k32, v32, valid[:, :, None, :], 0.35, want_scores=True,
                                                score_reduce=score_reduce)
    monkeypatch.setattr(ops, "NARROW_BLOCK_BYTES", rows_per_block * g * s * d * 4)
    out, scores = ops.narrow_decode_attention(q, k16, v16, valid, slot, k_new, v_new, 0.35, want_scores=True,
                                              score_reduce=score_reduce)
    assert torch.equal(out, ref_out)
    assert torch.equal(scores, ref_scores)
    assert torch.equal(k16, k_before) and torch.equal(v16, v_before)          # the cache's window is read only
    assert torch.all(scores[~valid] == 0)                                        # masked slots get no mass
    # the new token's own unrounded row is used, not the fp16 row the cache will store
    assert not torch.equal(k_new.half().float(), k_new)


def _staged_copies_only(monkeypatch) -> None:
    monkeypatch.setattr(OffloadPolicy, "kv_read_in_place", lambda self, *a: False)


@pytest.mark.parametrize("kind", ["llama-gqa", "opt"])
@pytest.mark.parametrize("policy", ["h2o", "full"])
def test_engine_decodes_the_same_over_its_own_fp16_window(monkeypatch, kind, policy):
    """fp16 KV homed in RAM, one cache part: every decode step attends over the cache's own window, and the
    tokens, every step's logits and the kept positions equal those of the run that stages an upcast copy (the
    torch ops: the compiled kernels are switched off, as its sums run in another order)."""
    monkeypatch.setenv(build.OFF_SWITCH, "0")                 # read by each engine as it is made
    eviction = EvictionConfig(policy=policy, hh_size=4, recent_size=3) if policy == "h2o" else None
    model = tiny_hf(kind)
    prompts = random_prompts([21, 14, 9])
    offload = OffloadPolicy.from_percent([100, 0, 100, 0, 100, 0], gpu_batch_size=3, kv_dtype="float16")
    calls = count_in_place_attention(monkeypatch)
    narrow = make_engine(model, eviction=eviction, offload=offload)
    out = narrow.generate(prompts, greedy(12))
    n_layers = model.config.num_hidden_layers
    assert len(calls) == 11 * n_layers                        # every decode step of every layer
    _staged_copies_only(monkeypatch)
    calls.clear()
    staged = make_engine(model, eviction=eviction, offload=offload)
    ref = staged.generate(prompts, greedy(12))
    assert not calls
    assert out.token_ids == ref.token_ids
    assert all(max_logit_diff(narrow.step_logits[i], staged.step_logits[i]) == 0.0 for i in range(len(prompts)))
    assert engine_kept(narrow) == engine_kept(staged)


@pytest.mark.parametrize("cache_percent, rolling", [((50, 50), False), ((100, 0), True)])
def test_split_and_rolling_caches_still_stage_a_copy(monkeypatch, cache_percent, rolling):
    monkeypatch.setenv("FLEXGEN_H2O_BATCH_INVARIANT", "0")   # which reads stored rows: test_batch_invariance.py
    calls = count_in_place_attention(monkeypatch)
    eviction = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, position_rolling=rolling)
    offload = OffloadPolicy.from_percent([100, 0, *cache_percent, 100, 0], gpu_batch_size=2, kv_dtype="float16")
    make_engine(tiny_hf("llama-gqa"), eviction=eviction, offload=offload).generate(random_prompts([12, 7]),
                                                                                    greedy(4))
    assert not calls


@pytest.mark.parametrize("cache_percent, kv_dtype, rolling", [
    ((100, 0), "float16", False),           # the one case that reads in place
    ((0, 100), "float16", False),           # host-homed is RAM too on a CPU
    ((100, 0), "float32", False),           # nothing to upcast
    ((100, 0), "float16", True),            # rolling re-rotates every key anyway
    ((50, 50), "float16", False),           # split across tiers: the parts' windows are joined
    ((0, 0), "float16", False),             # disk-homed: the copy is the read a worker overlaps
])
def test_in_place_rule_is_what_the_engine_does_and_what_the_planner_charges(monkeypatch, tmp_path, cache_percent,
                                                                            kv_dtype, rolling):
    """OffloadPolicy.kv_read_in_place says where the engine attends over the cache's own window, and the
    planner's workspace then holds no upcast window: it is smaller than for the same run with a staged copy."""
    from flexgen_h2o.planner import estimate
    from tests.helpers import weight_reader
    # the rule without batch invariance, whose staged copies of stored rows also reach the kernel (and are
    # smaller than the upcast window the planner charges: an upper bound)
    monkeypatch.setenv("FLEXGEN_H2O_BATCH_INVARIANT", "0")
    calls = count_in_place_attention(monkeypatch)
    eviction = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, position_rolling=rolling)
    offload = OffloadPolicy.from_percent([100, 0, *cache_percent, 100, 0], gpu_batch_size=2, kv_dtype=kv_dtype)
    model = tiny_hf("llama-gqa")
    make_engine(model, eviction=eviction, offload=offload, offload_dir=tmp_path).generate(random_prompts([12, 7]),
                                                                                          greedy(3))
    in_place = offload.kv_read_in_place("cpu", rolling, 2)
    assert in_place == bool(calls)
    assert not offload.kv_read_in_place("cuda", rolling, 2)
    cfg, _ = weight_reader(model)
    workspace = {}
    for rule in (True, False):
        monkeypatch.setattr(OffloadPolicy, "kv_read_in_place", lambda self, *a, rule=rule: rule)
        est = estimate(cfg, offload, eviction, prompt_len=12, gen_len=3, n_seqs=2)
        workspace[rule] = est.bytes["compute"]["workspace"]
    assert workspace[True] < workspace[False]
