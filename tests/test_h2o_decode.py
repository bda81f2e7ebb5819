"""H2O's decode half against the masked reference: short prompts with long generations, where the victims are
chosen by scores that decode steps accumulated; each sequence's own budget; the cache's scores and positions,
not only the tokens; on every tier; and ties resolved by position.

Each scenario first shows, on the reference alone, that it tests what it claims: the victims change when decode
steps add no attention mass (so decode-time scores chose some of them), and, for the tie case, when equal scores
are resolved the other way round. The engine must then agree with the reference, token for token, in its kept
positions and in the score of every kept token (tests/reference/h2o_masked.py)."""
from __future__ import annotations

import functools

import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.kv import EvictionConfig
from tests.helpers import (assert_scores_close, engine_kept, engine_scores, greedy, make_engine,
                           random_prompts, tiny_hf)
from tests.reference.h2o_masked import RULE_FOR_POLICY, reference_generate
from tests.reference.compare import PLACEMENTS, assert_same_as_reference, left_padded, score_bound

N_NEW = 48
SHORT, MEDIUM = [5, 9, 7], [12, 20, 16]
# name -> (rule, prompt lengths, each sequence's (sink, heavy, recent) worked out by hand from the flags)
CASES = {
    # prompts shorter than the budget: every victim is chosen in decode
    "h2o-sizes": (EvictionConfig(policy="h2o", hh_size=8, recent_size=3), SHORT, [(0, 8, 3)] * 3),
    # ratios of each prompt's own length: heavy = int(1.0 * n), recent = int(0.25 * n)
    "h2o-ratio": (EvictionConfig(policy="h2o", hh_ratio=1.0, recent_ratio=0.25), MEDIUM,
                  [(0, 12, 3), (0, 20, 5), (0, 16, 4)]),
    "h2o-ratio-sink": (EvictionConfig(policy="h2o", hh_ratio=1.0, recent_ratio=0.25, sink_size=1), MEDIUM,
                       [(1, 12, 3), (1, 20, 5), (1, 16, 4)]),
    "avg-ratio": (EvictionConfig(policy="h2o-avg", hh_ratio=0.25), MEDIUM, [(0, 3, 3), (0, 5, 5), (0, 4, 4)]),
    "port-sizes": (EvictionConfig(policy="h2o-port", hh_size=8, recent_size=3), SHORT, [(0, 8, 3)] * 3),
    # the port's per-block ratio: every sequence gets the budget of the block's longest prompt (20)
    "port-ratio": (EvictionConfig(policy="h2o-port", hh_ratio=0.5), MEDIUM, [(0, 10, 9)] * 3),
}


@functools.lru_cache(maxsize=None)
def reference(kind: str, case: str, decode_mass: bool = True, flip_ties: bool = False, q_scale: float = 1.0):
    """(tokens, logits, final kept positions, final kept scores, eviction record) of the reference, per sequence
    budgets."""
    ev, lens, budgets = CASES[case]
    model = peaked(kind, q_scale)
    ids, mask = left_padded(model, random_prompts(lens))
    trace: list = []
    scores: list = []
    evd: dict = {}
    tokens, logits = reference_generate(model, ids, mask, budgets, rule=RULE_FOR_POLICY[ev.policy],
                                        max_new_tokens=N_NEW, score_reduce=ev.score_reduce, trace=trace,
                                        scores=scores, decode_mass=decode_mass, flip_ties=flip_ties, eviction=evd)
    return tokens, logits, trace[-1], scores, evd


@functools.lru_cache(maxsize=None)
def peaked(kind: str, q_scale: float = 1.0):
    """The tiny model, its queries scaled by q_scale: at 256 attention is so peaked that most keys get exactly
    zero mass, and which of the equal scores goes first decides the victims."""
    model = tiny_hf(kind)
    if q_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "q_proj.weight" in name:
                    p.mul_(q_scale)               # a power of two: the weights stay exact in fp16
    return model


def check_case(kind: str, case: str, where: str, tmp_path, q_scale: float = 1.0, inspect=None,
               exact_ties: bool = False, **offload_kw) -> None:
    """exact_ties: the run's eviction choices are between scores that every path computes exactly (saturated
    attention: each probability exactly 0 or 1), so the kept positions must equal the reference's for every
    sequence, near-tie report or not: what decides them is the tie rule under test."""
    ev, lens, budgets = CASES[case]
    model = peaked(kind, q_scale)
    offload = OffloadPolicy(kv_dtype="float32", gpu_batch_size=len(lens), **PLACEMENTS.get(where, {}), **offload_kw)
    engine = make_engine(model, eviction=ev, offload=offload, offload_dir=tmp_path)
    try:
        out = engine.generate(random_prompts(lens), greedy(N_NEW))
        tiers = {c.tier_kind for caches in engine.last_caches for s in caches.values() for c in s.caches}
        assert tiers == ({"compute", "host", "disk"} if where == "mixed" else {where})
        ref_tokens, ref_logits, ref_kept, ref_scores, evd = reference(kind, case, q_scale=q_scale)
        # tokens and logits within the derived bounds up to a near tie (of the tokens' logits or of an eviction
        # choice's scores); kept positions and scores for the sequences no near tie split
        whole = assert_same_as_reference(model, engine, out, ref_tokens, ref_logits, evd)
        kept = engine_kept(engine)
        compared = range(len(lens)) if exact_ties else whole
        assert [[x[i] for i in compared] for x in kept] == [[x[i] for i in compared] for x in ref_kept]
        assert_scores_close(engine_scores(engine), ref_scores, score_bound(model, ref_tokens, evd), whole)
        if inspect is not None:
            inspect(engine)
        # every column ends at its own sequence's budget (eviction happened, each to its own count)
        for layer in kept:
            for seq, (sink, heavy, recent) in zip(layer, budgets):
                assert all(len(col) == sink + heavy + recent for col in seq)
    finally:
        engine.close()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["opt", "llama-gqa", "llama-mha"])
def test_decode_time_scores_choose_victims(kind, case, tmp_path):
    # the scenario is what it claims: without decode-time mass the reference keeps other tokens
    assert reference(kind, case)[2] != reference(kind, case, decode_mass=False)[2]
    check_case(kind, case, "compute", tmp_path)


@pytest.mark.parametrize("where", ["host", "disk", "mixed"])
@pytest.mark.parametrize("case", ["h2o-sizes", "h2o-ratio-sink", "avg-ratio", "port-sizes"])
@pytest.mark.parametrize("kind", ["opt", "llama-gqa"])
def test_decode_time_scores_on_every_tier(kind, case, where, tmp_path):
    check_case(kind, case, where, tmp_path)


@pytest.mark.parametrize("where", ["compute", "disk"])
@pytest.mark.parametrize("kind", ["opt", "llama-gqa"])
def test_equal_scores_evict_the_oldest(kind, where, tmp_path):
    """Peaked attention gives many keys exactly zero mass; the reference shows that the tie order decides the
    victims there, and the engine must resolve ties as it does (smallest position evicted first)."""
    assert reference(kind, "h2o-sizes", q_scale=256.0)[2] != \
        reference(kind, "h2o-sizes", flip_ties=True, q_scale=256.0)[2]
    check_case(kind, "h2o-sizes", where, tmp_path, q_scale=256.0, exact_ties=True)


@pytest.mark.parametrize("where", ["host", "mixed"])
@pytest.mark.parametrize("case", ["h2o-ratio-sink", "avg-ratio"])
def test_cpu_cache_compute_with_h2o(case, where, tmp_path, monkeypatch):
    """FlexGen's --cpu-cache-compute (decode attention where the KV lives), as the paper's OPT-30B runs use it
    with H2O. On a GPU this is the real split; on a CPU the engine's hook takes the same path (fp32 windows staged
    on the host, attention there) though the compute device is the host already."""
    monkeypatch.setattr(Engine, "host_attention_on_cpu", True)

    def host_attention(engine):
        splits = [s for caches in engine.last_caches for s in caches.values()]
        assert all(s.attention_device == torch.device("cpu") for s in splits)

    check_case("llama-gqa", case, where, tmp_path, inspect=host_attention, cpu_cache_compute=True)


def test_a_sequence_keeps_its_own_budget_in_any_batch():
    """The issue's case: a 20-token prompt at hh_ratio 0.2 keeps 4 heavy + 4 recent = 8 slots per column, alone and
    beside a 40-token prompt (whose own budget is 16). The port's per-block budget gives both the 40-token
    prompt's 8 heavy + 7 recent (its window is one short of heavy)."""
    model = tiny_hf("llama-gqa")
    short, long = random_prompts([20, 40])
    for policy, want in (("h2o", {"alone": 8, "batched": (16, 8)}), ("h2o-port", {"alone": 7, "batched": (15, 15)})):
        ev = EvictionConfig(policy=policy, hh_ratio=0.2)
        kept = {}
        for name, prompts in (("alone", [short]), ("batched", [long, short])):
            engine = make_engine(model, eviction=ev)
            engine.generate(prompts, greedy(8))
            kept[name] = [layer[-1] for layer in engine_kept(engine)]      # the short prompt's columns
            if name == "batched":
                assert {len(c) for layer in engine_kept(engine) for c in layer[0]} == {want[name][0]}
            engine.close()
        assert {len(c) for layer in kept["alone"] for c in layer} == {want["alone"]}
        assert {len(c) for layer in kept["batched"] for c in layer} == {want["batched"][-1]}
        if policy == "h2o":
            assert kept["alone"] == kept["batched"]
