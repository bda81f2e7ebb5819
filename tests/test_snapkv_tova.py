"""The question-aware rules (kv/snapkv.py, kv/tova.py) in the engine, against the masked reference extended with
each rule (tests/reference/h2o_masked.py): SnapKV ranks a prompt's keys by its last queries' attention pooled over
neighbouring keys and then evicts as H2O; TOVA keeps the keys the newest query attends to most, one choice for all
heads of a layer. OPT, Llama MHA and GQA, the compiled kernels and the torch ops, every KV tier, a prompt pass a
sequence at a time, batch invariance, the HF cache, and the flags. kvpress's own keep-sets are the outside check
(tests/benchmarks/test_kvpress_keep.py)."""
from __future__ import annotations

import pytest

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.hf import H2OCache
from flexgen_h2o.kernels import build
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kv.budget import describe
from tests.helpers import assert_alone_equals_batch, cli_error, random_prompts, tiny_hf
from tests.reference.compare import (LENGTHS, N_NEW, PLACEMENTS, all_caches, check_against_reference, check_hf_cache,
                                     reference_prompt_kept)

KINDS = ["opt", "llama-mha", "llama-gqa"]
# budgets of 8 slots: every prompt of LENGTHS (13-24 tokens) is cut in the prompt pass
SNAPKV = EvictionConfig(policy="snapkv", hh_size=4, score_window=4, pool_kernel=3)        # 4 heavy + 4 window
SNAPKV_SINK = EvictionConfig(policy="snapkv", hh_size=3, recent_size=3, sink_size=1, score_window=6,
                             pool_kernel=5)
TOVA = EvictionConfig(policy="tova", hh_size=4)                                          # 7 heavy + the newest
CASES = {"snapkv": SNAPKV, "snapkv-sink1": SNAPKV_SINK, "tova": TOVA}


def same_in_every_head(kept) -> bool:
    return all(all(col == seq[0] for col in seq) for layer in kept for seq in layer)


# --- against the reference ---

@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_matches_the_reference(kind, name):
    """Tokens, logits, kept slots and their scores, after a prompt pass that cut every prompt and decode steps
    that evicted; TOVA's heads keep the same tokens."""
    ev = CASES[name]
    trace = check_against_reference(kind, ev)
    budget = ev.resolve(max(LENGTHS), N_NEW).budget
    assert all(len(col) == budget for layer in trace[0] for seq in layer for col in seq)
    assert trace[0] != trace[-1]
    if ev.policy == "tova":
        assert all(same_in_every_head(t) for t in trace)


@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_torch_ops_match_the_reference(name, monkeypatch):
    """Without the compiled build (a GPU's path): the torch attention, commit and policies."""
    monkeypatch.setenv(build.OFF_SWITCH, "0")
    check_against_reference("llama-gqa", CASES[name])


@pytest.mark.parametrize("offload,tiers", [
    (dict(prefill_batch_size=1), {"compute"}),
    (dict(num_gpu_batches=1, **PLACEMENTS["mixed"]), {"compute", "host", "disk"}),
    (dict(**PLACEMENTS["disk"]), {"disk"}),
], ids=["chunked", "three-tiers", "disk"])
@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_every_tier_matches_the_reference(name, offload, tiers, tmp_path):
    policy = OffloadPolicy(kv_dtype="float32", gpu_batch_size=len(LENGTHS), **offload)

    def on_its_tiers(engine):
        assert {c.tier_kind for c in all_caches(engine)} == tiers

    check_against_reference("llama-gqa", CASES[name], inspect=on_its_tiers, offload=policy, offload_dir=tmp_path)


def test_the_rules_keep_what_they_say():
    """On one run of the reference: SnapKV's pooling changes what the prompt pass keeps beside its window alone,
    the window changes it beside H2O's every-query sum, and TOVA keeps other tokens than H2O."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)

    def prompt_kept(ev):
        return reference_prompt_kept(model, prompts, ev)
    pooled = prompt_kept(SNAPKV)
    unpooled = prompt_kept(EvictionConfig(policy="snapkv", hh_size=4, score_window=4, pool_kernel=1))
    h2o_window = prompt_kept(EvictionConfig(policy="h2o", hh_size=4, recent_size=4, score_window=4))
    h2o = prompt_kept(EvictionConfig(policy="h2o", hh_size=4, recent_size=4))
    assert pooled != unpooled and unpooled == h2o_window and h2o_window != h2o
    assert prompt_kept(TOVA) != prompt_kept(EvictionConfig(policy="h2o", hh_size=7, recent_size=1))


# --- batch invariance, refill's rows, the HF cache ---

@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_a_prompt_alone_and_in_a_padded_batch_bit_for_bit(kernel, name):
    """With the compiled kernels, each prompt's tokens, logits and kept slots equal its alone run's bit for bit,
    in a padded batch and in a prompt pass of two sequences at a time (pads beside a prompt never enter its
    pooling: they count as the zeros past its start)."""
    ev = EvictionConfig(policy=name, hh_ratio=0.2, **({"score_window": 6} if name == "snapkv" else {}))
    assert_alone_equals_batch(tiny_hf("llama-gqa"), random_prompts([5, 31, 12, 24]), ev, N_NEW)


@pytest.mark.parametrize("name", ["snapkv", "tova"])
def test_hf_cache_keeps_what_the_engine_keeps(name):
    """H2OCache with the rule's fields in transformers' generate, left-padded: the engine's tokens and slots."""
    check_hf_cache("llama-gqa", H2OCache(CASES[name]), CASES[name])


# --- budgets, the startup line and the flags ---

def test_the_budget_is_the_window_plus_the_best_scores():
    b = EvictionConfig(policy="snapkv", hh_ratio=0.1).resolve(2048, 512)
    assert (b.sink, b.heavy, b.recent, b.score_window, b.pool_kernel) == (0, 376, 32, 32, 31)
    b = EvictionConfig(policy="snapkv", kv_budget=204, score_window=32).resolve(2048, 16)
    assert (b.heavy, b.recent) == (172, 32)
    b = EvictionConfig(policy="snapkv", hh_size=10, recent_size=20).resolve(100, 8)     # a given window stays
    assert (b.heavy, b.recent) == (10, 20)
    b = EvictionConfig(policy="tova", hh_ratio=0.1).resolve(2048, 512)
    assert (b.heavy, b.recent, b.score_window) == (407, 1, 1)
    assert EvictionConfig(policy="snapkv", kv_budget=40).resolve(100, 8).budget == 40
    line = describe(EvictionConfig(policy="snapkv", hh_ratio=0.1).resolve(2048, 512), 2048, 512, 100.0)
    assert "last 32 prompt queries, averaged over 31 neighbouring keys" in line and "exact H2O" in line
    line = describe(EvictionConfig(policy="tova", hh_ratio=0.1).resolve(2048, 512), 2048, 512, 100.0)
    assert "the last prompt query" in line and "attends to least" in line


@pytest.mark.parametrize("fields,message", [
    (dict(policy="h2o", hh_size=4, pool_kernel=3), "policy 'h2o' does not pool"),
    (dict(policy="snapkv", hh_size=4, pool_kernel=4), "must be an odd integer"),
    (dict(policy="snapkv", hh_size=4, pool_kernel=0), "must be an odd integer"),
    (dict(policy="full", pool_kernel=3), "does not pool"),
])
def test_refused_requests(fields, message):
    with pytest.raises(ValueError, match=message):
        EvictionConfig(**fields)


@pytest.mark.parametrize("flags,message", [
    (["--pool-kernel", "5"], "--pool-kernel ranks the prompt tokens an eviction keeps: it needs a KV budget"),
    (["--pool-kernel", "4", "--policy", "snapkv", "--hh-ratio", "0.2"], "must be an odd integer"),
    (["--pool-kernel", "3", "--hh-ratio", "0.2"], "policy 'h2o' does not pool"),
])
def test_cli_refuses_bad_flags(flags, message, capsys, tmp_path, monkeypatch):
    err = cli_error(flags, capsys, tmp_path, monkeypatch)
    assert message in err, err


def test_the_policy_help_says_what_each_keeps():
    from flexgen_h2o.frontends.cli import build_parser
    text = " ".join(build_parser().format_help().split())
    for what in ("snapkv: prompt keys the question", "tova: the keys the newest query attends to most",
                 "h2o: heavy hitters by attention summed over every query"):
        assert what in text, what


@pytest.mark.parametrize("policy", ["snapkv", "tova"])
def test_the_planner_counts_the_same_cache_as_h2o_at_the_same_total(policy):
    """The rules split a budget differently, not its size: the planner's estimate (what the preflight and the cost
    model read) holds the same slots and bytes as h2o's at the same flags, and plans the scored prompt pass."""
    from flexgen_h2o.models import PRESETS
    from flexgen_h2o.planner import estimate
    offload = OffloadPolicy(gpu_batch_size=4)
    ests = {p: estimate(PRESETS["opt-125m"], offload, EvictionConfig(policy=p, hh_ratio=0.1), prompt_len=512,
                        gen_len=32, n_seqs=8) for p in ("h2o", policy)}
    h2o, new = ests["h2o"], ests[policy]
    assert new.plan.capacity == h2o.plan.capacity == 2 * 51 + 1
    assert new.plan.policy == policy and new.plan.needs_scores and new.plan.score_block > 0
    assert new.bytes == h2o.bytes


def test_a_batch_job_records_the_values_it_runs_with():
    """The settings record holds the window and pooling the rule runs with, so a resume that spells out a
    default is no change, and another value is."""
    from flexgen_h2o.frontends.cli import build_parser
    from flexgen_h2o.frontends.settings import answer_settings

    def record(*flags: str) -> dict:
        return answer_settings(build_parser().parse_args(["--model", "opt-125m", "--hh-ratio", "0.2", *flags]), 8)
    implicit, explicit = record("--policy", "snapkv"), record("--policy", "snapkv", "--score-window", "32",
                                                               "--pool-kernel", "31")
    assert implicit == explicit and (implicit["score_window"], implicit["pool_kernel"]) == (32, 31)
    assert record("--policy", "snapkv", "--pool-kernel", "5") != implicit
    assert (record()["score_window"], record()["pool_kernel"]) == (None, None)
    assert record("--policy", "tova")["score_window"] == 1
