"""Head-adaptive budgets (`--head-budgets adaptive`, kv/adaptive.py: AdaKV's allocation) and the ragged cache that
holds them (kv/ragged.py), against the masked reference extended with the rule (tests/reference/h2o_rule.py's
ref_adaptive_keep): tokens, logits, each head's kept slots and scores. OPT, Llama MHA and GQA, h2o and snapkv, the
compiled kernels and the torch ops, every KV tier, batch invariance, the HF cache, the memory it holds and the
flags. kvpress's AdaKVPress is the outside check (tests/benchmarks/test_kvpress_keep.py)."""
from __future__ import annotations

import pytest

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.hf import H2OCache
from flexgen_h2o.kernels import build
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kv.budget import describe
from flexgen_h2o.kv.ragged import RaggedKVCache
from tests.helpers import assert_alone_equals_batch, cli_error, count_in_place_attention, random_prompts, tiny_hf
from tests.reference.compare import (LENGTHS, N_NEW, PLACEMENTS, all_caches, check_against_reference, check_hf_cache,
                                     reference_prompt_kept, run_engine)

KINDS = ["opt", "llama-mha", "llama-gqa"]
# 7 slots per head: every prompt of LENGTHS (13-24 tokens) is cut in the prompt pass; the floor is 1 slot
H2O = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, head_budgets="adaptive")
SNAPKV = EvictionConfig(policy="snapkv", hh_size=4, score_window=3, pool_kernel=3, head_budgets="adaptive")
H2O_SINK = EvictionConfig(policy="h2o", hh_size=3, recent_size=2, sink_size=1, head_budgets="adaptive",
                          head_floor=0.5)
CASES = {"h2o": H2O, "snapkv": SNAPKV, "h2o-sink-floor": H2O_SINK}


def head_counts(engine) -> list[list[int]]:
    """Per (layer, sequence): each KV head's slot count after the prompt pass."""
    return [row for c in all_caches(engine) for row in c.head_counts()]


# --- against the reference ---

@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_matches_the_reference(kind, name):
    """Tokens, logits, kept slots and scores; the heads of a layer keep different counts that add up to the
    layer's total, each at least its floor, and decode evicts within each head."""
    ev = CASES[name]
    counts: list = []
    trace = check_against_reference(kind, ev, inspect=lambda engine: counts.extend(head_counts(engine)))
    budget = ev.resolve(max(LENGTHS), N_NEW)
    floor = max(1, int(budget.budget * ev.head_floor))
    assert all(sum(row) == len(row) * budget.budget and min(row) >= floor for row in counts)
    assert any(len(set(row)) > 1 for row in counts)             # some layer really splits its budget unevenly
    assert any(len({len(col) for col in seq}) > 1 for layer in trace[0] for seq in layer)     # the reference too
    assert trace[0] != trace[-1]


def test_torch_ops_match_the_reference(monkeypatch):
    """Without the compiled build (a GPU's path): the gathered windows, the torch commit and the policies."""
    monkeypatch.setenv(build.OFF_SWITCH, "0")
    check_against_reference("llama-gqa", SNAPKV)


@pytest.mark.parametrize("offload,tiers", [
    (dict(prefill_batch_size=1), {"compute"}),
    (dict(num_gpu_batches=1, **PLACEMENTS["mixed"]), {"compute", "host", "disk"}),
    (dict(**PLACEMENTS["disk"]), {"disk"}),
], ids=["chunked", "three-tiers", "disk"])
def test_every_tier_matches_the_reference(offload, tiers, tmp_path):
    policy = OffloadPolicy(kv_dtype="float32", gpu_batch_size=len(LENGTHS), **offload)

    def on_its_tiers(engine):
        assert {c.tier_kind for c in all_caches(engine)} == tiers
        assert all(isinstance(c, RaggedKVCache) for c in all_caches(engine))

    check_against_reference("llama-gqa", SNAPKV, inspect=on_its_tiers, offload=policy, offload_dir=tmp_path)


def test_the_allocation_is_not_the_uniform_one():
    """On one run of the reference: the adaptive prompt pass keeps other tokens than the uniform one at the same
    budget, and a floor of 1 (each head its whole share) is the uniform rule."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)

    def prompt_kept(ev):
        return reference_prompt_kept(model, prompts, ev)
    uniform = EvictionConfig(policy="h2o", hh_size=4, recent_size=3)
    assert prompt_kept(H2O) != prompt_kept(uniform)
    assert prompt_kept(EvictionConfig(policy="h2o", hh_size=4, recent_size=3, head_budgets="adaptive",
                                      head_floor=1.0)) == prompt_kept(uniform)


# --- memory and reads ---

def test_the_cache_holds_the_layer_total_and_attention_reads_each_heads_own_slots(monkeypatch):
    """The ragged cache allocates what a uniform cache of the same budget does (g x capacity slots per sequence),
    though a head holds more than capacity slots; the compiled decode attention walks each head's own run in the
    cache's own rows, and the engine counts the bytes of those runs only."""
    calls = count_in_place_attention(monkeypatch)
    policy = OffloadPolicy(gpu_batch_size=len(LENGTHS))          # fp16 KV, read in place
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    engines = {n: run_engine(model, prompts, ev, offload=policy)
               for n, ev in (("adaptive", H2O), ("uniform", EvictionConfig(policy="h2o", hh_size=4, recent_size=3)))}
    try:
        ragged, uniform = (all_caches(engines[n][0]) for n in ("adaptive", "uniform"))
        assert [c.nbytes for c in ragged] == [c.nbytes for c in uniform]
        assert any(int(c.col_cap.max()) > c.capacity for c in ragged)
        assert calls                                             # decode attention read the cache in place
        for c in ragged:
            slots = int(c.col_cap.clamp(max=c.n_used).sum())
            assert c._window_bytes(c.n_used) == slots * (2 * c.k.shape[-1] * c.k.element_size() + 8)
    finally:
        for engine, _ in engines.values():
            engine.close()


# --- batch invariance, refill's rows, compression, the HF cache ---

@pytest.mark.parametrize("name", ["h2o", "snapkv"])
def test_a_prompt_alone_and_in_a_padded_batch_bit_for_bit(kernel, name):
    """Each prompt's heads take their shares from its own scores alone: tokens, logits and kept slots equal its
    alone run's bit for bit, in a padded batch and in a prompt pass of two sequences at a time."""
    ev = EvictionConfig(policy=name, hh_ratio=0.2, head_budgets="adaptive",
                        **({"score_window": 6} if name == "snapkv" else {}))
    assert_alone_equals_batch(tiny_hf("llama-gqa"), random_prompts([5, 31, 12, 24]), ev, N_NEW)


def test_hf_cache_keeps_what_the_engine_keeps():
    """H2OCache with head-adaptive budgets in transformers' generate, left-padded: the engine's tokens and slots."""
    kept = check_hf_cache("llama-gqa", H2OCache(SNAPKV), SNAPKV)
    assert any(len({len(col) for col in seq}) > 1 for layer in kept for seq in layer)


# --- budgets, the startup line and the flags ---

def test_the_startup_line_says_the_heads_share_their_slots():
    line = describe(EvictionConfig(policy="snapkv", hh_ratio=0.1, head_budgets="adaptive").resolve(2048, 512),
                    2048, 512, 100.0)
    assert "head budgets adaptive" in line and "at least 20% of its own" in line
    assert "head budgets" not in describe(EvictionConfig(policy="snapkv", hh_ratio=0.1).resolve(2048, 512),
                                          2048, 512, 100.0)


@pytest.mark.parametrize("fields,message", [
    (dict(policy="tova", hh_size=4, head_budgets="adaptive"), "policy 'tova' cannot"),
    (dict(policy="local", hh_size=4, head_budgets="adaptive"), "policy 'local' cannot"),
    (dict(policy="h2o", hh_size=4, head_budgets="per-head"), "head_budgets must be one of"),
    (dict(policy="h2o", hh_size=4, head_budgets="adaptive", head_floor=1.5), "must be in \\[0, 1\\]"),
])
def test_refused_requests(fields, message):
    with pytest.raises(ValueError, match=message):
        EvictionConfig(**fields)


@pytest.mark.parametrize("flags,message", [
    (["--head-budgets", "adaptive"], "--head-budgets ranks the prompt tokens an eviction keeps: it needs a KV budget"),
    (["--head-floor", "0.3", "--hh-ratio", "0.2"], "--head-floor sets the least share of a head"),
    (["--head-budgets", "adaptive", "--policy", "tova", "--hh-ratio", "0.2"], "policy 'tova' cannot"),
])
def test_cli_refuses_bad_flags(flags, message, capsys, tmp_path, monkeypatch):
    err = cli_error(flags, capsys, tmp_path, monkeypatch)
    assert message in err, err


def test_the_planner_counts_the_same_cache_as_uniform_heads():
    """A layer's heads share its slots, so the planner's estimate (the preflight's and the cost model's) is the
    uniform cache's at the same flags."""
    from flexgen_h2o.models import PRESETS
    from flexgen_h2o.planner import estimate
    offload = OffloadPolicy(gpu_batch_size=4)
    ests = [estimate(PRESETS["opt-125m"], offload, EvictionConfig(policy="snapkv", hh_ratio=0.1, head_budgets=h),
                     prompt_len=512, gen_len=32, n_seqs=8) for h in ("uniform", "adaptive")]
    assert ests[0].plan.capacity == ests[1].plan.capacity and ests[0].bytes == ests[1].bytes


def test_a_batch_job_records_head_budgets_only_when_adaptive():
    from flexgen_h2o.frontends.cli import build_parser
    from flexgen_h2o.frontends.settings import answer_settings
    parse = build_parser().parse_args
    base = ["--model", "opt-125m", "--hh-ratio", "0.2", "--policy", "snapkv"]
    uniform = answer_settings(parse(base), 8)
    assert uniform["head_budgets"] is None and uniform["head_floor"] is None
    adaptive = answer_settings(parse(base + ["--head-budgets", "adaptive"]), 8)
    assert (adaptive["head_budgets"], adaptive["head_floor"]) == ("adaptive", 0.2)
    assert answer_settings(parse(base + ["--head-budgets", "adaptive", "--head-floor", "0.2"]), 8) == adaptive
