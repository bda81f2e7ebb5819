"""Engine.prefill + generate(prefilled=...): one prompt pass, many eviction rules decoding from it.

Each rule's cache is cut from the kept prefill by the same commit_prefill a normal run makes, so a rule that
scores (h2o, h2o-port) gives exactly the normal run's logits; the score-free rules' own runs use the fused
attention kernel in the prompt, so theirs agree to fp32 rounding, with the same tokens.
"""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.config import ConfigError, OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from tests.helpers import greedy, make_engine, max_logit_diff, random_prompts, tiny_hf

LENGTHS = [20, 13, 24, 9, 17]          # padded, and 3 blocks of 2 with gbs 1 x 2 below
N_NEW = 10
RULES = {
    "h2o": EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1),
    "h2o-port": EvictionConfig(policy="h2o-port", hh_size=4, recent_size=3),
    "h2o-avg": EvictionConfig(policy="h2o-avg", hh_size=4, recent_size=3),
    "local": EvictionConfig(policy="local", recent_size=7),
    "sink": EvictionConfig(policy="sink", recent_size=5),
    "random": EvictionConfig(policy="random", kv_budget=8, seed=3),
    "full": EvictionConfig(policy="full"),
}
SCORED = ("h2o", "h2o-port", "h2o-avg")


def policy(gbs: int = 1, **kw) -> OffloadPolicy:
    return OffloadPolicy(kv_dtype="float32", gpu_batch_size=gbs, num_gpu_batches=2, **kw)


def run(engine, prompts, ev, **kw):
    engine.step_logits = {}
    out = engine.generate(prompts, greedy(N_NEW), eviction=ev, **kw)
    return out.token_ids, dict(engine.step_logits)


@pytest.mark.parametrize("kind", ["opt", "llama-gqa"])
def test_every_rule_decodes_from_one_prefill(kind):
    engine = make_engine(tiny_hf(kind), offload=policy())
    prompts = random_prompts(LENGTHS)
    shared = engine.prefill(prompts)
    assert len(shared) == 3                                  # one per block
    for name, ev in RULES.items():
        want_tokens, want_logits = run(engine, prompts, ev)
        got_tokens, got_logits = run(engine, prompts, ev, prefilled=shared)
        assert got_tokens == want_tokens, name
        tol = 0.0 if name in SCORED else 1e-5
        for s in range(len(prompts)):
            assert len(got_logits[s]) == N_NEW
            assert max_logit_diff(got_logits[s], want_logits[s]) <= tol, (name, s)


def test_kept_positions_equal_a_normal_run():
    engine = make_engine(tiny_hf("llama-gqa"), offload=policy())
    prompts = random_prompts(LENGTHS)
    shared = engine.prefill(prompts)
    ev = RULES["h2o"]
    engine.generate(prompts, greedy(N_NEW), eviction=ev)
    want = [[c.kept_positions() for c in split.caches] for caches in engine.last_caches for split in caches.values()]
    engine.generate(prompts, greedy(N_NEW), eviction=ev, prefilled=shared)
    got = [[c.kept_positions() for c in split.caches] for caches in engine.last_caches for split in caches.values()]
    assert got == want


def test_rolling_rules_need_a_rolling_prefill():
    engine = make_engine(tiny_hf("llama-gqa"), offload=policy())
    prompts = random_prompts(LENGTHS)
    ev = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1, position_rolling=True)
    want_tokens, want_logits = run(engine, prompts, ev)
    got_tokens, got_logits = run(engine, prompts, ev, prefilled=engine.prefill(prompts, rolling=True))
    assert got_tokens == want_tokens
    assert all(max_logit_diff(got_logits[s], want_logits[s]) == 0.0 for s in range(len(prompts)))
    with pytest.raises(ConfigError, match="rolling"):
        engine.generate(prompts, greedy(N_NEW), eviction=ev, prefilled=engine.prefill(prompts))


def test_teacher_forcing_and_stops_from_a_prefill():
    engine = make_engine(tiny_hf("opt"), offload=policy())
    prompts = random_prompts(LENGTHS)
    forced = [random_prompts([N_NEW], seed=10 + i)[0] for i in range(len(prompts))]
    ev = RULES["h2o"]
    engine.step_logits = {}
    engine.generate(prompts, greedy(N_NEW), eviction=ev, forced=forced, max_new_tokens=[N_NEW, 1, 3, N_NEW, 2])
    want = dict(engine.step_logits)
    engine.step_logits = {}
    out = engine.generate(prompts, greedy(N_NEW), eviction=ev, forced=forced, max_new_tokens=[N_NEW, 1, 3, N_NEW, 2],
                          prefilled=engine.prefill(prompts))
    assert [len(t) for t in out.token_ids] == [N_NEW, 1, 3, N_NEW, 2]
    assert all(torch.equal(torch.stack(engine.step_logits[s]), torch.stack(want[s])) for s in want)


def test_prefilled_on_offloaded_caches(tmp_path):
    engine = make_engine(tiny_hf("llama-gqa"), offload=policy(2, cache_gpu_pct=0, cache_cpu_pct=50),
                         offload_dir=tmp_path)
    try:
        prompts = random_prompts(LENGTHS[:4])               # one block of 2 x 2: each batch on host and disk
        ev = RULES["h2o"]
        want_tokens, want_logits = run(engine, prompts, ev)
        got_tokens, got_logits = run(engine, prompts, ev, prefilled=engine.prefill(prompts))
        assert {c.tier_kind for caches in engine.last_caches for s in caches.values() for c in s.caches} == \
            {"host", "disk"}
        assert got_tokens == want_tokens
        assert all(max_logit_diff(got_logits[s], want_logits[s]) == 0.0 for s in range(len(prompts)))
    finally:
        engine.close()


def test_prefilled_for_other_prompts_is_refused():
    engine = make_engine(tiny_hf("opt"), offload=policy())
    prompts = random_prompts(LENGTHS)
    shared = engine.prefill(prompts)
    with pytest.raises(ConfigError, match="other prompts"):
        engine.generate(prompts[::-1], greedy(N_NEW), prefilled=shared)
    with pytest.raises(ConfigError, match="other prompts"):
        engine.generate(prompts[:2], greedy(N_NEW), prefilled=shared)
