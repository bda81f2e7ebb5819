"""The compiled prompt attention (kernels.Kernels.scored_prompt_attention, csrc/scored_attention.cpp) against the
torch-op path it replaces on a CPU (ops.grouped_attention with want_scores), and the engine with it against the
engine without."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.kernels import build, dispatch, resolve
from flexgen_h2o.models import ops
from tests.tolerances import EPS32, assert_within, attention_bounds, gamma, greedy_agreement, logit_bound
from tests.helpers import engine_kept, greedy, make_engine, max_logit_diff, random_prompts, tiny_hf


def _reference(q, k, v, token_valid, scale, score_reduce="sum"):
    b, t = q.shape[0], q.shape[2]
    valid = torch.ones(b, t, dtype=torch.bool) if token_valid is None else token_valid
    return ops.grouped_attention(q, k, v, ops.causal_pad_mask(valid), scale, want_scores=True,
                                 query_valid=token_valid, score_reduce=score_reduce,
                                 causal_only=token_valid is None)


def _scored(kernel, q, k, v, token_valid, scale, score_reduce="sum"):
    """The kernel's prompt pass as a layer calls it: no pads (token_valid None) is every token valid, unpadded."""
    valid = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool) if token_valid is None else token_valid
    return kernel.scored_prompt_attention(q, k, v, valid, token_valid is None, scale, score_reduce, 256)


def _bounds(q, k, v, token_valid, scale, score_reduce="sum"):
    """tolerances.attention_bounds on the prompt's causal, pad-hiding mask (the kernel and the torch path: two
    fp32 orders); "mean" divides each score by the group's r heads, one rounding more."""
    b, t = q.shape[0], q.shape[2]
    valid = torch.ones(b, t, dtype=torch.bool) if token_valid is None else token_valid
    out, mass = attention_bounds(q, k, v, ops.causal_pad_mask(valid), scale, valid)
    r = q.shape[1] // k.shape[1]
    return out, (mass / r * (1 + 2 * EPS32) if score_reduce == "mean" else mass)


def _inputs(b, h, g, t, d, pads=()):
    torch.manual_seed(0)
    q = torch.randn(b, t, h, d).transpose(1, 2)           # a head view, as split_heads gives it
    k, v = torch.randn(b, g, t, d), torch.randn(b, g, t, d)
    valid = None
    if pads:
        valid = torch.ones(b, t, dtype=torch.bool)
        for row, n in enumerate(pads):
            valid[row, :n] = False
    return q, k, v, valid


@pytest.mark.parametrize("b, h, g, t, pads", [
    (2, 6, 2, 23, ()),             # GQA, no pads
    (3, 4, 4, 17, (0, 5, 16)),     # MHA, left pads up to all but one token
    (1, 6, 3, 30, ()),             # one sequence, an odd number of groups: tasks split unevenly
    (2, 3, 1, 9, (2, 0)),          # one KV head
])
@pytest.mark.parametrize("q_block", [1, 4, 64])
@pytest.mark.parametrize("score_reduce", ["sum", "mean"])
def test_kernel_gives_the_torch_paths_output_and_key_mass(kernel, monkeypatch, b, h, g, t, pads, q_block,
                                                         score_reduce):
    monkeypatch.setattr(dispatch, "Q_BLOCK", q_block)        # 1 and 4: many blocks, odd counts, mirror pairs
    q, k, v, valid = _inputs(b, h, g, t, 8, pads)
    ref_out, ref_mass = _reference(q, k, v, valid, 0.4, score_reduce)
    out, mass = _scored(kernel, q, k, v, valid, 0.4, score_reduce)
    assert out.shape == ref_out.shape and mass.shape == ref_mass.shape == (b, g, t)
    out_bound, mass_bound = _bounds(q, k, v, valid, 0.4, score_reduce)
    assert_within(out, ref_out, out_bound, "output")
    assert_within(mass, ref_mass, mass_bound, "key mass")
    valid_queries = torch.full((b,), float(t)) if valid is None else valid.sum(1).float()
    heads_pooled = 1 if score_reduce == "mean" else h // g          # every valid query spends a mass of 1
    # each query row's probabilities sum to 1 within 2 gamma(t + 3) (exp, sum, division; then this sum), the
    # kernel's n r rows added per key and the g t keys added here: gamma of each count more
    rel = 2 * gamma(t + 3) + gamma(t * h + 2) + gamma(g * t + 1)
    want_total = g * heads_pooled * valid_queries
    assert_within(mass.sum(dim=(1, 2)), want_total, rel * want_total, "mass in all")
    if valid is not None:
        assert torch.all(mass.permute(0, 2, 1)[~valid] == 0)   # a pad key is seen only by itself, a pad query


def test_kernel_is_the_same_on_one_thread_and_two(kernel, monkeypatch):
    """Each thread sums its blocks' key mass into its own row, added up at the end."""
    monkeypatch.setattr(dispatch, "Q_BLOCK", 4)
    q, k, v, valid = _inputs(2, 6, 3, 40, 8, pads=(3, 0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _scored(kernel, q, k, v, valid, 0.3)
        torch.set_num_threads(2)
        two = _scored(kernel, q, k, v, valid, 0.3)
        threads_after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert threads_after == 2                      # the kernel's one-thread GEMMs do not leak out of it
    assert torch.equal(one[0], two[0])
    # per-thread key-mass rows added in another order: within the score sums' bound
    assert_within(one[1], two[1], _bounds(q, k, v, valid, 0.3)[1], "key mass")


def test_a_single_task_on_the_calling_thread_leaves_its_thread_count(kernel):
    """One sequence, one KV head, one query block: parallel_for runs it on the caller, whose OpenMP setting the
    kernel narrows to one thread while it runs and must put back (else every later torch op runs on one core)."""
    q, k, v, _ = _inputs(1, 2, 1, 5, 8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _scored(kernel, q, k, v, None, 0.3)
        threads_after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert threads_after == 2


@pytest.mark.parametrize("kind", ["llama-gqa", "opt"])
def test_engine_with_the_kernel_keeps_and_generates_what_it_does_without(kernel, monkeypatch, kind):
    """Every layer's prompt pass goes to the kernel, and the H2O run gives the same tokens and kept positions
    as the torch path, logits to fp32 rounding; a padded block (prompts of three lengths) included."""
    calls = []
    real = kernel.ext.scored_prompt_attention
    monkeypatch.setattr(kernel.ext, "scored_prompt_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny_hf(kind)
    prompts = random_prompts([21, 14, 9])
    eviction = EvictionConfig(policy="h2o", hh_size=4, recent_size=3)
    compiled = make_engine(model, eviction=eviction)
    out = compiled.generate(prompts, greedy(8))
    # batch-invariant kernels attend each sequence alone (ops.per_sequence_attention): one call per sequence
    per_layer = len(prompts) if compiled.kernels.batch_invariant else 1
    assert len(calls) == model.config.num_hidden_layers * per_layer
    monkeypatch.setenv(build.OFF_SWITCH, "0")                 # read when the engine resolves its kernels
    calls.clear()
    plain = make_engine(model, eviction=eviction)
    assert compiled.kernels.ext is kernel.ext and plain.kernels.ext is None
    ref = plain.generate(prompts, greedy(8))
    assert not calls
    # two fp32 orders of the same model: tokens equal but at a near tie, logits within tolerances.logit_bound
    for i in range(len(prompts)):
        bound = logit_bound(model, torch.stack(ref_logits := plain.step_logits[i]))
        n = greedy_agreement(out.token_ids[i], ref.token_ids[i], ref_logits, bound, f"sequence {i}")
        assert max_logit_diff(compiled.step_logits[i][:n], ref_logits[:n]) <= bound, f"sequence {i}"
    assert engine_kept(compiled) == engine_kept(plain)


def test_full_cache_prompt_does_not_use_the_kernel(kernel, monkeypatch):
    """No scores wanted: the prompt stays on torch's fused SDPA, which skips the blocks above the diagonal
    (kernels/dispatch.py's table)."""
    calls = []
    monkeypatch.setattr(kernel.ext, "scored_prompt_attention", lambda *a, **kw: calls.append(1))
    make_engine(tiny_hf("llama-gqa")).generate(random_prompts([12, 7]), greedy(2))
    assert not calls


def test_hf_cache_attends_through_the_engines_kernels(kernel, monkeypatch):
    """H2OCache's attention function calls the entry points the engine calls, on the cache's Kernels: on a CPU
    every layer's prompt goes to the compiled prompt kernel (sequence by sequence with batch invariance) and every
    decode step to the compiled decode kernel's fp32 reader (kernels/dispatch.py's table)."""
    from flexgen_h2o.hf import H2OCache, enable_h2o
    calls = {"scored_prompt_attention": [], "decode_attention": []}
    for name, seen in calls.items():
        real = getattr(kernel.ext, name)
        monkeypatch.setattr(kernel.ext, name, lambda *a, real=real, seen=seen: seen.append(1) or real(*a))
    model = enable_h2o(tiny_hf("llama-gqa"))
    prompts = random_prompts([12, 7, 9])
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    cache = H2OCache(hh_size=3, recent_size=2)
    assert cache.kernels.ext is kernel.ext
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    layers = model.config.num_hidden_layers
    per_layer = len(prompts) if cache.kernels.batch_invariant else 1
    assert len(calls["scored_prompt_attention"]) == layers * per_layer
    assert len(calls["decode_attention"]) == (layers * 3 if cache.kernels.batch_invariant else 0)


def test_a_failed_build_falls_back_to_torch_ops_and_says_why_once(monkeypatch, capsys):
    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "build", no_compiler)
    assert build.load() is None and resolve().ext is None
    err = capsys.readouterr().err
    assert err.count("compiled kernels unavailable") == 1 and "Ninja is required" in err
    assert build.unavailable_reason() == "Ninja is required to load C++ extensions"
    eviction = EvictionConfig(policy="h2o", hh_size=4, recent_size=3)
    engine = make_engine(tiny_hf("llama-gqa"), eviction=eviction)
    assert engine.kernels.ext is None
    out = engine.generate(random_prompts([12, 7]), greedy(3))
    assert all(len(ids) == 3 for ids in out.token_ids)


def test_the_switch_turns_it_off_without_building(monkeypatch):
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "build", lambda: pytest.fail("must not build when switched off"))
    monkeypatch.setenv(build.OFF_SWITCH, "0")
    kernels = resolve()
    assert kernels.ext is None and kernels.name == "torch" and build.unavailable_reason() is None
    assert build.build_ahead() == 1                                  # nothing built, and it says so
