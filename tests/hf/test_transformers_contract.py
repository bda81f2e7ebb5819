"""transformers' own cache checks, rewritten for H2OCache (issue 36), on real SmolLM2-135M-Instruct weights.

The model is the HF folder written from our converted store (benchmarks/model_formats.hf_folder: the GGUF's
weights rounded to fp16, stored and computed in fp32). The baseline is stock transformers: sdpa attention and
DynamicCache. H2OCache runs with the flexgen_h2o attention and, unless a test says otherwise, a budget that
covers the whole sequence (padded prompt + new tokens), so it evicts nothing and must give DynamicCache's
tokens exactly. Every generate call here passes the cache as `cache=` (transformers 5.24's name) and checks
that no deprecation warning about `past_key_values` was raised.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LogitsProcessor, LogitsProcessorList

from benchmarks.model_formats import hf_folder
from flexgen_h2o.hf import H2OCache, enable_h2o
from flexgen_h2o.loader import ensure_store

pytestmark = pytest.mark.slow

N_NEW = 10
PROMPTS = ["A sequence: 1, 2, 3, 4, 5", "A sequence: A, B, C"]
EXPECTED = ["A sequence: 1, 2, 3, 4, 5, 6, 7, 8,", "A sequence: A, B, C, D, E, F, G, H"]


@pytest.fixture(scope="module")
def smol():
    """(model, tokenizer): fp32 SmolLM2 from the HF folder with the flexgen_h2o attention (the baseline runs
    switch to sdpa and back), left padding as transformers' tests set it."""
    ensure_store("smollm2-135m", progress=False)     # the embedded GGUF converted once, as tests/test_smollm2.py
    folder = hf_folder()
    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return enable_h2o(model), tok


def generate(model, inputs, cache, n_new=N_NEW, attention="h2o", **kw):
    """Greedy generate with `cache` passed as `cache=`; attention "h2o" (flexgen_h2o) or "sdpa" (stock)."""
    if attention == "sdpa":
        model.set_attn_implementation("sdpa")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(**inputs, cache=cache, max_new_tokens=n_new, do_sample=False,
                                 return_dict_in_generate=True, **kw)
    finally:
        enable_h2o(model)
    stale = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not stale, stale
    return out


def whole(inputs, n_new=N_NEW) -> H2OCache:
    """An H2OCache whose budget holds the padded prompt and every new token: nothing is evicted."""
    return H2OCache(kv_budget=inputs["input_ids"].shape[1] + n_new)


@pytest.fixture(scope="module")
def batched(smol):
    """The batch of transformers' test_cache_batched, generated once by the baseline and by H2OCache."""
    model, tok = smol
    inputs = tok(PROMPTS, padding=True, return_tensors="pt")
    base = generate(model, inputs, DynamicCache(), attention="sdpa", output_logits=True)
    h2o = generate(model, inputs, whole(inputs), output_logits=True)
    return inputs, base, h2o


def stores(cache):
    return [layer.store for layer in cache.layers]


def test_batched_greedy_strings(smol, batched):
    """From transformers tests/utils/test_cache_utils.py, CacheIntegrationTest.test_cache_batched: two
    left-padded prompts, 10 greedy tokens, the strings transformers expects (they hold with these weights in
    fp32), for DynamicCache and for H2OCache; H2OCache's ids equal DynamicCache's, and its logits agree to fp32
    rounding (the attention is sdpa against the engine's math: 5e-5 apart here)."""
    model, tok = smol
    inputs, base, h2o = batched
    assert int(inputs["attention_mask"].sum(1).min()) < inputs["input_ids"].shape[1]      # really padded
    assert isinstance(base.cache, DynamicCache) and isinstance(h2o.cache, H2OCache)      # a cache was used
    assert tok.batch_decode(base.sequences, skip_special_tokens=True) == EXPECTED
    assert tok.batch_decode(h2o.sequences, skip_special_tokens=True) == EXPECTED
    assert torch.equal(h2o.sequences, base.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(h2o.logits, base.logits, strict=True)) <= 5e-4
    # nothing was evicted: every real token fed to the model is kept (the last new one is never fed)
    real = inputs["attention_mask"].sum(1) + N_NEW - 1
    for layer in h2o.cache.kept_positions():
        assert [len(head) for row in layer for head in row] == [int(n) for n, row in zip(real, layer) for _ in row]
    assert h2o.cache.get_seq_length() == base.cache.get_seq_length() == h2o.sequences.shape[1] - 1


def test_extra_left_padding_changes_nothing(smol, batched):
    """From test_cache_utils.py, CacheIntegrationTest.test_cache_extra_left_padding: padding the prompts to a
    multiple of 32 gives the same generation. (Its own expected string for "The cat" came from fp16 weights on a
    GPU and does not hold here, so the batch above is used, against its unpadded run.) Pads are never kept, so
    H2OCache keeps the same true positions as without the extra padding."""
    model, tok = smol
    inputs, base, h2o = batched
    wide = tok(PROMPTS, padding=True, pad_to_multiple_of=32, return_tensors="pt")
    assert wide["input_ids"].shape[1] == 32 > inputs["input_ids"].shape[1]
    out = generate(model, wide, whole(wide))
    width, wide_width = inputs["input_ids"].shape[1], wide["input_ids"].shape[1]
    assert torch.equal(out.sequences[:, wide_width:], base.sequences[:, width:])
    assert tok.batch_decode(out.sequences, skip_special_tokens=True) == EXPECTED
    assert out.cache.kept_positions() == h2o.cache.kept_positions()


def test_continue_from_returned_cache(smol, batched):
    """From transformers tests/generation/test_utils.py, GenerationTesterMixin
    .test_generate_continue_from_past_key_values: generate N tokens returning the cache, generate again on
    the returned sequences with that cache (attention mask extended with ones): the same tokens as one run of
    2N, and the same cache as that run's (transformers compares them with _check_caches_are_equal)."""
    model, tok = smol
    inputs, base, h2o = batched
    half = N_NEW // 2
    cache = whole(inputs)
    first = generate(model, inputs, cache, n_new=half)
    assert first.cache is cache and cache.get_seq_length() == first.sequences.shape[1] - 1
    mask = torch.nn.functional.pad(inputs["attention_mask"], (0, half), value=1)
    second = generate(model, {"input_ids": first.sequences, "attention_mask": mask}, cache, n_new=N_NEW - half)
    assert second.cache is cache
    assert torch.equal(second.sequences, base.sequences)
    # the same forwards on the same shapes (the prompt pass, then one token per step, the cache's same slots):
    # the same ops in the same order, so bit for bit on any CPU
    for got, want in zip(stores(cache), stores(h2o.cache), strict=True):
        for name in ("pos", "k", "v", "score"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("num_beams", [2, 3])
def test_beam_search_whole_budget_equals_dynamic_cache(smol, num_beams):
    """From test_cache_utils.py, CacheIntegrationTest.test_cache_beam_search: "Blue is", 10 tokens, beams
    returned; some returned sequence went through more than one beam index, so the cache had to be reordered.
    The expected strings there came from fp16 weights on a GPU and do not hold here; the check is equality
    with DynamicCache's beams."""
    model, tok = smol
    inputs = tok(["Blue is"], return_tensors="pt")
    kw = dict(num_beams=num_beams, num_return_sequences=num_beams)
    base = generate(model, inputs, DynamicCache(), attention="sdpa", **kw)
    out = generate(model, inputs, whole(inputs), **kw)
    assert any(len(set(beams.tolist())) > 1 for beams in out.beam_indices)
    assert torch.equal(out.sequences, base.sequences)
    assert torch.equal(out.beam_indices, base.beam_indices)


class Snapshot(LogitsProcessor):
    """Records, at each beam step, the running sequences and every layer's kept positions and scores: the
    cache has just taken in exactly those sequences, row for row, and has not been reordered yet."""

    def __init__(self, cache):
        self.cache, self.steps = cache, []

    def __call__(self, input_ids, scores):
        self.steps.append((input_ids.clone(), [(s.pos.clone(), s.score.clone()) for s in stores(self.cache)]))
        return scores


def test_beam_reorder_moves_scores_with_their_beams(smol, monkeypatch):
    """transformers reorders the cache with Cache.reorder_cache(beam_idx) after each beam step
    (GenerationMixin._beam_search; the check of test_cache_beam_search). With a budget that evicts, H2O's
    accumulated scores must move with the keys: after the beams have been shuffled, each row of the cache must
    be what a fresh H2OCache holds after taking that row's sequence token by token."""
    model, tok = smol
    inputs = tok([PROMPTS[0]], return_tensors="pt")
    cache = H2OCache(hh_size=4, recent_size=4)
    snap, reorders, reorder = Snapshot(cache), [], cache.reorder_cache
    monkeypatch.setattr(cache, "reorder_cache", lambda beam_idx: (reorders.append(beam_idx), reorder(beam_idx)))
    generate(model, inputs, cache, n_new=8, num_beams=3, logits_processor=LogitsProcessorList([snap]))
    # the beams were shuffled before the last snapshot (the last reorder comes after it)
    assert any(b.tolist() != [0, 1, 2] for b in reorders[:len(snap.steps) - 1])
    seqs, kept = snap.steps[-1]
    prompt = inputs["input_ids"].shape[1]
    assert seqs.shape == (3, prompt + 7)
    fresh = H2OCache(hh_size=4, recent_size=4)
    with torch.no_grad():
        model(input_ids=seqs[:, :prompt], attention_mask=torch.ones_like(seqs[:, :prompt]), cache=fresh)
        for t in range(prompt, seqs.shape[1]):
            model(input_ids=seqs[:, t:t + 1], attention_mask=torch.ones_like(seqs[:, :t + 1]), cache=fresh)
    evicted = False
    for (pos, score), want in zip(kept, stores(fresh), strict=True):
        assert torch.equal(pos, want.pos)
        torch.testing.assert_close(score, want.score, rtol=1e-5, atol=1e-6)
        evicted |= bool(((pos >= 0).sum(-1) < seqs.shape[1]).all())
    assert evicted                                # the budget of 8 really evicted


def test_batch_maps_move_every_per_sequence_tensor(smol):
    """Cache.reorder_cache, batch_repeat_interleave and batch_select_indices (transformers' CacheLayerMixin
    contract, test_cache_utils.py CacheTest.test_reorder_cache_retrocompatibility for the reorder) on known
    tensors: K, V, scores, positions and next positions move row for row, and the cache then decodes like a
    fresh cache built on the mapped batch. (Before the fix, a map that changed the batch size left the store's
    per-sequence budget counts at the old size, and the next decode step failed in the compiled commit.)"""
    model, tok = smol
    inputs = tok(PROMPTS, padding=True, return_tensors="pt")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    cache = H2OCache(hh_size=3, recent_size=3)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
    before = [(s.k.clone(), s.v.clone(), s.score.clone(), s.pos.clone()) for s in stores(cache)]
    next_pos = cache.layers[0].next_pos.clone()
    assert all(bool((b[2] > 0).any()) for b in before)              # there are scores to move

    cache.reorder_cache(torch.tensor([1, 0]))
    cache.batch_repeat_interleave(2)                                  # rows 1, 1, 0, 0
    cache.batch_select_indices(torch.tensor([3, 0, 1]))               # rows 0, 1, 1: a batch of 3 now
    cache.reorder_cache(torch.tensor([0, 2, 2]))                      # rows 0, 1, 1: one beam in two slots
    rows = torch.tensor([0, 1, 1])
    for s, old in zip(stores(cache), before, strict=True):
        for got, want in zip((s.k, s.v, s.score, s.pos), old, strict=True):
            assert torch.equal(got, want[rows])
    assert torch.equal(cache.layers[0].next_pos, next_pos[rows])

    step = torch.tensor([[11], [11], [11]])
    fresh = H2OCache(hh_size=3, recent_size=3)
    with torch.no_grad():
        model(input_ids=ids[rows], attention_mask=mask[rows], cache=fresh)
        for c in (cache, fresh):
            model(input_ids=step, attention_mask=torch.cat([mask[rows], torch.ones_like(step)], 1), cache=c)
    for got, want in zip(stores(cache), stores(fresh), strict=True):
        assert torch.equal(got.pos, want.pos)
        torch.testing.assert_close(got.score, want.score, rtol=1e-5, atol=1e-6)


def test_budget_below_the_prompt_evicts_and_stays_at_the_budget(smol):
    """Sanity, beyond transformers' tests: a budget of 6 slots, smaller than either prompt, still generates
    every token, and every layer keeps exactly 6 tokens per (sequence, KV head) in budget + 1 slots, the
    newest among them."""
    model, tok = smol
    inputs = tok(PROMPTS, padding=True, return_tensors="pt")
    assert int(inputs["attention_mask"].sum(1).min()) > 6
    cache = H2OCache(hh_size=3, recent_size=3)
    out = generate(model, inputs, cache, min_new_tokens=N_NEW)
    assert out.sequences.shape[1] == inputs["input_ids"].shape[1] + N_NEW
    assert cache.get_seq_length() == out.sequences.shape[1] - 1
    newest = inputs["attention_mask"].sum(1) + N_NEW - 2                 # true position of the last token fed
    for layer in cache.layers:
        assert layer.store.k.shape[:3] == (2, 3, 7)
        kept = layer.kept_positions()
        assert {len(head) for row in kept for head in row} == {6}
        assert all(row[g][-1] == int(newest[b]) for b, row in enumerate(kept) for g in range(3))


def test_cache_argument_raises_no_deprecation_warning(smol, batched):
    """transformers 5.24 renamed generate's `past_key_values` to `cache` (deprecate_kwarg in
    generation/utils.py: a FutureWarning until its removal). H2OCache is passed as `cache=` here and in
    flexgen_h2o/hf, docs/hf.md and benchmarks/hf_cache.py; this checks that the warning capture would see
    the old name."""
    model, tok = smol
    inputs = tok(["Blue is"], return_tensors="pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(**inputs, past_key_values=whole(inputs, 1), max_new_tokens=1, do_sample=False)
    old = [w for w in caught if "past_key_values" in str(w.message)]
    assert old and all(issubclass(w.category, FutureWarning) and "cache" in str(w.message) for w in old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(**inputs, cache=whole(inputs, 1), max_new_tokens=1, do_sample=False)
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
