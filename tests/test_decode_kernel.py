"""The compiled decode attention (kernels.Kernels.narrow_decode_attention, csrc/decode_attention.cpp) against the
torch-op path it replaces on a CPU (ops.narrow_decode_attention over the same fp16 window), and the engine with it
against the engine without."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import ops
from tests.helpers import (count_in_place_attention, engine_kept, greedy, make_engine, max_logit_diff,
                           random_prompts, tiny_hf)
from tests.kernel_inputs import DECODE_SHAPES, decode_step
from tests.tolerances import assert_within, decode_attention_bounds, gamma, greedy_agreement, logit_bound


def _within_bounds(got, want, args, scale, reduce="sum"):
    """The torch path's softmax and products round differently per CPU: output and key mass within
    tolerances.decode_attention_bounds, derived from the logits' dot-product bound carried through softmax and the
    value sums."""
    out_bound, mass_bound = decode_attention_bounds(*args, scale, reduce)
    assert_within(got[0], want[0], out_bound, "output")
    assert_within(got[1], want[1], mass_bound, "key mass")

@pytest.mark.parametrize("b, h, g, s, d, capacity", DECODE_SHAPES)
@pytest.mark.parametrize("score_reduce", ["sum", "mean"])
def test_kernel_gives_the_torch_paths_output_and_key_mass(kernel, b, h, g, s, d, capacity, score_reduce):
    args = decode_step(b, h, g, s, d, capacity)
    q, k, v, valid, slot, k_new, v_new = args
    before = k.clone(), v.clone()
    ref_out, ref_mass = ops.narrow_decode_attention(*args, 0.3, want_scores=True, score_reduce=score_reduce)
    out, mass = kernel.narrow_decode_attention(*args, 0.3, want_scores=True, score_reduce=score_reduce)
    _within_bounds((out, mass), (ref_out, ref_mass), args, 0.3, score_reduce)
    assert torch.all(mass[~valid] == 0)                       # free slots get exactly no mass
    per_column = 1.0 if score_reduce == "mean" else h // g    # each query head spends a mass of 1
    # each head's probabilities sum to 1 within 2 gamma(s + 3) (exp, sum, division; then this sum), the r
    # heads' columns added (gamma(r + 1) more: "mean"'s division included)
    rel = 2 * gamma(s + 3) + gamma(h // g + 1)
    assert_within(mass.sum(-1), torch.full((b, g), float(per_column)), rel * per_column, "mass per column")
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])   # the cache's window is read only
    out_only, none = kernel.narrow_decode_attention(*args, 0.3, want_scores=False)
    assert none is None and torch.equal(out_only, out)


def test_peaked_attention_and_a_new_token_that_differs_from_its_fp16_row(kernel):
    """Logits tens apart (a softmax that a careless exp would overflow or flush) and the new token's key used
    unrounded, as the torch path does: both show in the output."""
    args = decode_step(2, 9, 3, 50, 64, 64, q_scale=12.0)
    ref = ops.narrow_decode_attention(*args, 0.125, want_scores=True)
    got = kernel.narrow_decode_attention(*args, 0.125, want_scores=True)
    _within_bounds(got, ref, args, 0.125)
    q, k, v, valid, slot, k_new, v_new = args
    rounded = kernel.narrow_decode_attention(q, k, v, valid, slot, k_new.half().float(), v_new.half().float(), 0.125)
    assert not torch.equal(rounded[0], got[0])


def test_freed_slots_are_never_read(kernel):
    """A freed slot still holds an evicted token's row; whatever it holds (here inf and NaN) must not reach the
    output or the mass, as if the slot held zeros."""
    q, k, v, valid, slot, k_new, v_new = decode_step(3, 6, 2, 40, 64, 40, free=0.4)
    clean = kernel.narrow_decode_attention(q, k, v, valid, slot, k_new, v_new, 0.3, want_scores=True)
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[~valid] = float("nan")
    dirty_v[~valid] = float("inf")
    dirty = kernel.narrow_decode_attention(q, dirty_k, dirty_v, valid, slot, k_new, v_new, 0.3, want_scores=True)
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1])


def test_a_column_reads_only_up_to_its_own_extent(kernel):
    """A row in a window sized for a longer batch-mate (or a refilled row packed from slot 0 again) has masked slots
    past its last valid one: its output and mass are bitwise what the window cut at its extent gives, whatever the
    slots past it hold, and the mass there is exactly 0. (The window's width used to change the key blocks and
    softmax tails a column's sums fell in.)"""
    q, k, v, valid, slot, k_new, v_new = decode_step(3, 9, 3, 29, 64, 29, seed=3)
    wide = 29 + 38
    k_wide = torch.cat([k, torch.full((3, 3, 38, 64), float("nan")).half()], 2)
    v_wide = torch.cat([v, torch.full((3, 3, 38, 64), float("inf")).half()], 2)
    valid_wide = torch.cat([valid, torch.zeros(3, 3, 38, dtype=torch.bool)], 2)
    narrow = kernel.narrow_decode_attention(q, k, v, valid, slot, k_new, v_new, 0.3, want_scores=True)
    got = kernel.narrow_decode_attention(q, k_wide, v_wide, valid_wide, slot, k_new, v_new, 0.3, want_scores=True)
    assert got[1].shape[-1] == wide and torch.all(got[1][..., 29:] == 0)
    assert torch.equal(got[0], narrow[0]) and torch.equal(got[1][..., :29], narrow[1])


def test_kernel_is_the_same_on_one_thread_and_two(kernel):
    """Each (sequence, KV head) column is computed whole by one thread, so the split changes nothing."""
    args = decode_step(5, 9, 3, 100, 64, 128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.narrow_decode_attention(*args, 0.3, want_scores=True)
        torch.set_num_threads(2)
        two = kernel.narrow_decode_attention(*args, 0.3, want_scores=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_bad_inputs_are_refused_by_name(kernel):
    q, k, v, valid, slot, k_new, v_new = decode_step(2, 4, 2, 10, 16, 10)
    with pytest.raises(RuntimeError, match="v must be a 4-d float32"):
        kernel.ext.decode_attention(q, k.float(), v, valid, slot, k_new, v_new, 0.3, True, False)
    with pytest.raises(RuntimeError, match="write slot"):
        kernel.ext.decode_attention(q, k, v, valid, slot + 10, k_new, v_new, 0.3, True, False)


def test_only_an_fp32_query_goes_to_the_kernel(kernel, monkeypatch):
    """What the compiled path takes (the windows decode_step makes, as the engine hands them over, and fp32 copies of
    them) and what it leaves to the torch ops (an fp16 query)."""
    calls = []
    real = kernel.ext.decode_attention
    monkeypatch.setattr(kernel.ext, "decode_attention", lambda *a: calls.append(1) or real(*a))
    q, k, v, valid, slot, k_new, v_new = decode_step(2, 4, 2, 10, 16, 12)
    kernel.narrow_decode_attention(q.half(), k, v, valid, slot, k_new, v_new, 0.3, want_scores=True)
    assert not calls
    kernel.narrow_decode_attention(q, k, v, valid, slot, k_new, v_new, 0.3, want_scores=True)
    kernel.narrow_decode_attention(q, k.float(), v.float(), valid, slot, k_new, v_new, 0.3, want_scores=True)
    assert calls == [1, 1]


def test_an_fp32_window_attends_as_the_fp16_window(kernel):
    """The same values as fp32 rows (fp16 converts exactly) through the same loops: the fp32 reader staged copies
    use (rolled keys, fp32 KV) gives the fp16 window's result, to the rounding of the multiply-adds the compiler
    may fuse in one instantiation and not the other (the derived bound, as against the torch ops)."""
    for r in (1, 2, 3, 4):
        q, k, v, valid, slot, k_new, v_new = decode_step(3, 2 * r, 2, 21, 16, 24)
        half = kernel.ext.decode_attention(q, k, v, valid, slot, k_new, v_new, 0.3, True, False)
        full = kernel.ext.decode_attention(q, k.float(), v.float(), valid, slot, k_new, v_new, 0.3, True, False)
        _within_bounds(full, half, (q, k, v, valid, slot, k_new, v_new), 0.3)


@pytest.mark.parametrize("kind", ["llama-gqa", "opt"])
@pytest.mark.parametrize("policy", ["h2o", "h2o-avg", "full"])
def test_engine_with_the_decode_kernel_keeps_and_generates_what_it_does_without(kernel, monkeypatch, kind,
                                                                                 policy):
    """fp16 KV read in place: every decode step of every layer goes to the kernel, and the run gives the same
    tokens and kept positions as the torch-op path, every step's logits to fp32 rounding."""
    calls = []
    real = kernel.ext.decode_attention
    monkeypatch.setattr(kernel.ext, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model = tiny_hf(kind)
    prompts = random_prompts([21, 14, 9])
    eviction = EvictionConfig(policy=policy, hh_size=4, recent_size=3) if policy != "full" else None
    offload = OffloadPolicy.from_percent([100, 0, 100, 0, 100, 0], gpu_batch_size=3, kv_dtype="float16")
    compiled = make_engine(model, eviction=eviction, offload=offload)
    out = compiled.generate(prompts, greedy(12))
    assert len(calls) == 11 * model.config.num_hidden_layers
    torch_calls = count_in_place_attention(monkeypatch)
    plain = make_engine(model, eviction=eviction, offload=offload)
    # the same engine with its decode attention alone on the torch ops (ops.narrow_decode_attention)
    monkeypatch.setattr(plain.kernels, "narrow_decode_attention", ops.TORCH.narrow_decode_attention)
    ref = plain.generate(prompts, greedy(12))
    assert len(torch_calls) == 11 * model.config.num_hidden_layers
    assert len(calls) == 11 * model.config.num_hidden_layers        # the kernel took none of them
    # two fp32 orders of the same model: tokens equal but at a near tie, logits within tolerances.logit_bound
    for i in range(len(prompts)):
        bound = logit_bound(model, torch.stack(plain.step_logits[i]))
        n = greedy_agreement(out.token_ids[i], ref.token_ids[i], plain.step_logits[i], bound, f"sequence {i}")
        assert max_logit_diff(compiled.step_logits[i][:n], plain.step_logits[i][:n]) <= bound, f"sequence {i}"
    assert engine_kept(compiled) == engine_kept(plain)
