"""The engine's REAL eviction (fixed slots, vectorised policies, every placement) against the slow masked
reference in tests/reference/h2o_masked.py: same tokens, same logits, same kept positions; and the cache
really stays budget + 1 slots whatever the run length."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig, get_policy
from tests.helpers import assert_agree, max_logit_diff, random_prompts, tiny_hf
from tests.reference.compare import (LENGTHS, N_NEW, PLACEMENTS, all_caches, assert_same_as_reference,
                                     check_against_reference, run_engine, run_reference)

KINDS = ["opt", "llama-mha", "llama-gqa"]
H2O = EvictionConfig(policy="h2o", hh_size=4, recent_size=3)
H2O_SINK = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1)


# --- 1. h2o exact vs the reference, eviction in prefill and decode ---

@pytest.mark.parametrize("ev", [H2O, H2O_SINK], ids=["h2o", "h2o-sink1"])
@pytest.mark.parametrize("kind", KINDS)
def test_h2o_matches_reference(kind, ev):
    trace = check_against_reference(kind, ev)
    budget = ev.resolve(max(LENGTHS), N_NEW).budget
    # eviction really happened in the prefill (every prompt is longer than the budget) ...
    assert all(len(col) == budget for layer in trace[0] for seq in layer for col in seq)
    # ... and in decode: prompt tokens the prefill kept were evicted later, and generated tokens were kept
    pairs = [(start, end) for l0, l1 in zip(trace[0], trace[-1]) for s0, s1 in zip(l0, l1)
             for start, end in zip(s0, s1)]
    assert any(set(start) - set(end) for start, end in pairs)
    assert all(max(end) >= min(LENGTHS) for _, end in pairs)


# --- 2. the other deterministic policies vs their reference rules ---

@pytest.mark.parametrize("ev", [
    EvictionConfig(policy="h2o-port", hh_size=4, recent_size=3),
    EvictionConfig(policy="h2o-port", hh_size=3, recent_size=2, sink_size=1),
    EvictionConfig(policy="local", recent_size=7),
    EvictionConfig(policy="sink", recent_size=5),                   # 4 sinks + 5 window
    EvictionConfig(policy="sink", hh_size=2, recent_size=3, sink_size=1),   # heavy share goes to the window
], ids=["port", "port-sink1", "local", "sink", "sink-hh"])
@pytest.mark.parametrize("kind", ["opt", "llama-gqa"])
def test_other_policies_match_reference(kind, ev):
    check_against_reference(kind, ev)


# --- 2b. h2o-avg: the exact rule on the per-query average, against the reference's own tally of the mask ---

@pytest.mark.parametrize("ev", [
    EvictionConfig(policy="h2o-avg", hh_size=4, recent_size=3),
    EvictionConfig(policy="h2o-avg", hh_size=3, recent_size=2, sink_size=1, score_reduce="mean"),
], ids=["avg", "avg-sink1-mean"])
@pytest.mark.parametrize("kind", KINDS)
def test_h2o_avg_matches_reference(kind, ev):
    trace = check_against_reference(kind, ev)
    assert all(len(col) == ev.resolve(max(LENGTHS), N_NEW).budget for layer in trace[-1] for seq in layer
               for col in seq)                          # eviction really happened


def test_h2o_avg_keeps_other_tokens_than_the_sum():
    """The average must really re-rank: on the same run it keeps other positions than h2o, and newer ones
    (the sum's bias is toward old keys)."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    kept = {}
    for policy in ("h2o", "h2o-avg"):
        trace: list = []
        run_reference(model, prompts, EvictionConfig(policy=policy, hh_size=4, recent_size=3), trace=trace)
        kept[policy] = [p for layer in trace[0] for seq in layer for col in seq for p in col]
    assert kept["h2o"] != kept["h2o-avg"]
    assert sum(kept["h2o-avg"]) > sum(kept["h2o"])


# --- 3. score_reduce="mean" ---

@pytest.mark.parametrize("kind", ["llama-mha", "llama-gqa"])
def test_score_reduce_mean_matches_reference(kind):
    model = tiny_hf(kind)
    prompts = random_prompts(LENGTHS)
    ev = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, score_reduce="mean")
    engine, out = run_engine(model, prompts, ev)
    evd: dict = {}
    ref_tokens, ref_logits = run_reference(model, prompts, ev, eviction=evd)
    assert_same_as_reference(model, engine, out, ref_tokens, ref_logits, evd)
    # mean really divides the group's mass by its size (2 query heads per KV head for GQA, 1 for MHA)
    summed, _ = run_engine(model, prompts, H2O)
    group = 2 if kind == "llama-gqa" else 1
    for mine, theirs in zip(engine.last_caches[0].values(), summed.last_caches[0].values()):
        a, b = mine.caches[0], theirs.caches[0]
        assert torch.equal(a.pos, b.pos)
        # bit for bit: the same run (same kernels, shapes, order) but each step's mass divided by 1 or 2, both
        # exact in binary, so every running sum is exactly the sum's divided
        assert torch.equal(a.score * group, b.score)


# --- 4. a budget that covers the run is the full cache, bit for bit ---

@pytest.mark.parametrize("kind", KINDS)
def test_big_budget_is_bit_identical_to_full(kind, monkeypatch):
    model = tiny_hf(kind)
    prompts = random_prompts(LENGTHS)
    covering = EvictionConfig(policy="h2o", hh_size=100, recent_size=100)
    big, out_big = run_engine(model, prompts, covering)
    full, out_full = run_engine(model, prompts, EvictionConfig(policy="full"))
    assert out_big.token_ids == out_full.token_ids
    for i in range(len(prompts)):
        assert all(torch.equal(a, b) for a, b in zip(big.step_logits[i], full.step_logits[i]))
    # the bits come from switching to the full policy (kv.policy_for); the H2O machinery itself, scoring and
    # choosing victims under a covering budget, must agree too: it never evicts, and only the summation order
    # of the unfused attention differs
    monkeypatch.setattr("flexgen_h2o.planner.plan.policy_for", lambda ev, budget: get_policy(ev.policy))
    scored, out_scored = run_engine(model, prompts, covering)
    assert_agree(model, out_scored.token_ids, scored.step_logits, out_full.token_ids, full.step_logits, False)
    assert all((c.pos >= 0).sum(-1).max() == c.n_used for c in all_caches(scored))   # nothing was freed


# --- 5. sequences stay independent under eviction ---

@pytest.mark.parametrize("kind", KINDS)
def test_each_sequence_alone_equals_batched(kind):
    model = tiny_hf(kind)
    prompts = random_prompts(LENGTHS)
    batched, together = run_engine(model, prompts, H2O_SINK)
    for i, p in enumerate(prompts):
        alone, single = run_engine(model, [p], H2O_SINK)
        assert_agree(model, [single.token_ids[0]], [alone.step_logits[0]], [together.token_ids[i]],
                     [batched.step_logits[i]], batched.kernels.batch_invariant)


# --- 6. the memory is really fixed ---

def test_cache_size_fixed_over_a_long_run():
    model = tiny_hf("llama-gqa")                     # OPT's 256 learned positions cannot hold 24 + 256
    prompts = random_prompts([24, 13])
    budget = H2O_SINK.resolve(24, 256).budget
    short, _ = run_engine(model, prompts, H2O_SINK, n_new=1, record=False)
    long, out = run_engine(model, prompts, H2O_SINK, n_new=256, record=False)
    assert [len(t) for t in out.token_ids] == [256, 256]
    assert [c.nbytes for c in all_caches(short)] == [c.nbytes for c in all_caches(long)]
    for c in all_caches(long):
        assert c.capacity == budget + 1 and c.k.shape[2] == budget + 1
        assert int((c.pos >= 0).sum(-1).max()) <= budget
        assert all(len(col) == budget for seq in c.kept_positions() for col in seq)


@pytest.mark.parametrize("policy", ["h2o", "full"])
def test_decode_bytes_read_per_step(policy):
    model = tiny_hf("llama-gqa")
    prompts = random_prompts([24, 13])
    ev = H2O if policy == "h2o" else EvictionConfig(policy="full")
    per_step = []
    for n_new in (16, 48):
        engine, out = run_engine(model, prompts, ev, n_new=n_new, record=False)
        read = sum(sum(c.bytes_read.values()) for c in all_caches(engine))
        assert out.metrics["decode_steps"] == n_new - 1
        per_step.append(read / (n_new - 1))
        if policy == "h2o":                          # every decode step reads exactly the budget + 1 slots
            assert read == (n_new - 1) * sum(c._slot_bytes(c.capacity) for c in all_caches(engine))
    if policy == "h2o":
        assert per_step[0] == per_step[1]            # per-step bytes do not depend on the run length
    else:
        assert per_step[1] > per_step[0] * 1.4       # the full cache reads a growing window (avg 32 -> 48 slots)


# --- 7. placements, schedule and position rolling ---

MANY = [20, 13, 24, 9, 17, 22]


@pytest.fixture(scope="module")
def compute_run():
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(MANY)
    engine, out = run_engine(model, prompts, H2O_SINK)
    return model, prompts, out.token_ids, engine.step_logits


@pytest.mark.parametrize("ngb", [1, 3])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("where", list(PLACEMENTS))
def test_placements_match_compute(compute_run, tmp_path, where, overlap, ngb):
    model, prompts, want_tokens, want_logits = compute_run
    offload = OffloadPolicy(kv_dtype="float32", gpu_batch_size=len(prompts) // ngb, num_gpu_batches=ngb,
                            overlap=overlap, **PLACEMENTS[where])
    engine, out = run_engine(model, prompts, H2O_SINK, offload=offload, offload_dir=tmp_path)
    try:
        kinds = {c.tier_kind for c in all_caches(engine)}
        assert kinds == ({"compute", "host", "disk"} if (where, ngb) == ("mixed", 1) else
                         {"compute", "host"} if where == "mixed" else {where})
        assert_agree(model, out.token_ids, engine.step_logits, want_tokens, want_logits,
                     engine.kernels.batch_invariant)
    finally:
        engine.close()


# --- 8. prefill in sequence chunks (a large GPU batch whose prompt transients stay one chunk's) ---

ROLLING_SINK = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1, position_rolling=True)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("kind, ev", [("opt", H2O_SINK), ("llama-gqa", H2O_SINK), ("llama-gqa", ROLLING_SINK)],
                         ids=["opt-h2o-sink1", "llama-gqa-h2o-sink1", "llama-gqa-rolling"])    # rolling needs RoPE
def test_chunked_prefill_matches_reference(kind, ev, rows):
    offload = OffloadPolicy(kv_dtype="float32", gpu_batch_size=len(LENGTHS), prefill_batch_size=rows)
    check_against_reference(kind, ev, offload=offload)


@pytest.mark.parametrize("offload,tiers", [
    (dict(prefill_batch_size=1), {"compute"}),
    (dict(num_gpu_batches=1, **PLACEMENTS["mixed"]), {"compute", "host", "disk"}),
], ids=["chunked", "three-tiers"])
def test_h2o_avg_offloaded_matches_reference(offload, tiers, tmp_path):
    """The per-query count comes from positions, so it must hold when the cache is split across tiers and when
    the prompt pass runs a sequence at a time."""
    policy = OffloadPolicy(kv_dtype="float32", gpu_batch_size=len(LENGTHS), **offload)
    ev = EvictionConfig(policy="h2o-avg", hh_size=4, recent_size=3, sink_size=1)

    def on_its_tiers(engine):
        assert {c.tier_kind for c in all_caches(engine)} == tiers

    check_against_reference("llama-gqa", ev, inspect=on_its_tiers, offload=policy, offload_dir=tmp_path)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_chunked_prefill_across_tiers_matches_compute(compute_run, tmp_path, rows):
    """Chunks that straddle the compute/host/disk parts of a mixed cache commit to the right rows."""
    model, prompts, want_tokens, want_logits = compute_run
    offload = OffloadPolicy(kv_dtype="float32", gpu_batch_size=len(prompts), prefill_batch_size=rows,
                            **PLACEMENTS["mixed"])
    engine, out = run_engine(model, prompts, H2O_SINK, offload=offload, offload_dir=tmp_path)
    try:
        assert {c.tier_kind for c in all_caches(engine)} == {"compute", "host", "disk"}
        assert_agree(model, out.token_ids, engine.step_logits, want_tokens, want_logits,
                     engine.kernels.batch_invariant)
    finally:
        engine.close()


def test_rolling_without_eviction_equals_full():
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    roll, out_roll = run_engine(model, prompts, EvictionConfig(policy="h2o", hh_size=100, recent_size=100,
                                                               position_rolling=True))
    full, out_full = run_engine(model, prompts, EvictionConfig(policy="full"))
    # rolling turns keys by rank, here equal to the position, through another rotation path: two fp32 orders
    assert_agree(model, out_roll.token_ids, roll.step_logits, out_full.token_ids, full.step_logits, False)


@pytest.mark.parametrize("ev", [
    EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1, position_rolling=True),
    EvictionConfig(policy="h2o-port", hh_size=3, recent_size=4, position_rolling=True),
    EvictionConfig(policy="sink", recent_size=5, position_rolling=True),
    EvictionConfig(policy="h2o-avg", hh_size=4, recent_size=3, position_rolling=True),
], ids=["h2o-sink1", "port", "streamingllm", "avg"])
@pytest.mark.parametrize("kind", ["llama-mha", "llama-gqa", "llama3"])
def test_rolling_with_eviction_matches_reference(kind, ev):
    trace = check_against_reference(kind, ev)
    assert all(len(col) == ev.resolve(max(LENGTHS), N_NEW).budget for layer in trace[-1] for seq in layer
               for col in seq)                          # eviction really happened


@pytest.mark.parametrize("where", ["host", "disk"])
def test_rolling_on_offloaded_caches_matches_reference(where, tmp_path):
    ev = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1, position_rolling=True)
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    offload = OffloadPolicy(kv_dtype="float32", gpu_batch_size=2, num_gpu_batches=2, **PLACEMENTS[where])
    engine, out = run_engine(model, prompts, ev, offload=offload, offload_dir=tmp_path)
    try:
        evd: dict = {}
        ref_tokens, ref_logits = run_reference(model, prompts, ev, eviction=evd)
        assert_same_as_reference(model, engine, out, ref_tokens, ref_logits, evd)
    finally:
        engine.close()


def test_rolling_with_eviction_uses_ranks():
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    ev = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1, position_rolling=True)
    roll, out = run_engine(model, prompts, ev)
    plain, _ = run_engine(model, prompts, H2O_SINK)
    assert all(len(t) == N_NEW for t in out.token_ids)
    # once tokens are evicted, rotating by rank instead of true position changes the logits
    assert max(max_logit_diff(roll.step_logits[i], plain.step_logits[i]) for i in range(len(prompts))) > 1e-3
    # at attention the kept tokens of every (b, g) rotate at ranks 0..n-1 and the new token at n = budget
    budget = ev.resolve(max(LENGTHS), N_NEW).budget
    for c in all_caches(roll):
        view = c.stage(torch.device("cpu"), torch.float32, torch.full((c.batch,), budget))
        for b in range(c.batch):
            for g in range(c.spec.n_kv_heads):
                slot = int(view.write_slot[b, g])
                kept = view.valid[b, g].clone()
                kept[slot] = False
                assert sorted(view.key_positions[b, g][kept].tolist()) == list(range(budget))
                assert int(view.key_positions[b, g, slot]) == budget
