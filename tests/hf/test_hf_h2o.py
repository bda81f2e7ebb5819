"""H2OCache inside transformers' own `generate`, on tiny random Llama (MHA, GQA) and OPT models, against the
engine's real eviction (tests/helpers.make_engine) and the slow masked reference (tests/reference/h2o_masked):
same greedy tokens (but at a near tie), logits within tolerances.logit_bound (three fp32 orders), the same kept
positions; a budget that covers the run is DynamicCache; the cache's bytes never move over 256 decode steps."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from flexgen_h2o.hf import H2OCache, H2OLayer, enable_h2o
from flexgen_h2o.kv import EvictionConfig
from tests.helpers import engine_kept, max_logit_diff, random_prompts, tiny_hf
from tests.reference.fake_quant import fake_quant
from tests.quant_inputs import EngineQuantInputs, first_flipped_step, reference_inputs
from tests.reference.compare import (SEED, left_padded, quantized_reference, run_engine, run_reference,
                                     same_run)
from tests.tolerances import EPS32, assert_within, attention_bounds, gamma, greedy_agreement, logit_bound

LENGTHS = [20, 13, 24]           # every prompt is longer than the budgets below: eviction starts in prefill
N_NEW = 16
H2O = EvictionConfig(policy="h2o", hh_size=4, recent_size=3)
H2O_SINK = EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1)


def hf_generate(model, prompts, cache, n_new: int = N_NEW, **kw):
    """Greedy `model.generate` on the left-padded batch: (tokens (b, n_new), per-step fp32 logits)."""
    ids, mask = left_padded(model, prompts)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id, eos_token_id=None, **kw)
    return out.sequences[:, ids.shape[1]:], [l.float() for l in out.logits]


def h2o_model(kind: str):
    return enable_h2o(tiny_hf(kind))


# --- 1. same tokens, logits and kept tokens as the engine and the reference ---

# Long prompts: the prompt's column sums decide (the tiny models' attention is peaked, so heavy hitters from
# the prompt outscore anything a few decode steps can add). Short prompts + long runs: decode accumulation
# decides too (test_short_cases_depend_on_decode_scores proves it for each of them).
SHORT, SHORT_NEW = [6, 4, 7], 24
CASES = [(k, H2O, LENGTHS, N_NEW) for k in ("llama-mha", "llama-gqa", "opt")]
CASES += [(k, H2O_SINK, LENGTHS, N_NEW) for k in ("llama-mha", "llama-gqa", "opt")]
CASES += [(k, ev, LENGTHS, N_NEW) for k in ("llama-gqa", "opt") for ev in (
    EvictionConfig(policy="h2o-port", hh_size=4, recent_size=3),
    EvictionConfig(policy="h2o-avg", hh_size=4, recent_size=3),
    EvictionConfig(policy="local", recent_size=7),
    EvictionConfig(policy="sink", recent_size=5))]
SHORT_CASES = [(k, EvictionConfig(policy="h2o", hh_size=6, recent_size=1), SHORT, SHORT_NEW)
               for k in ("llama-mha", "llama-gqa", "opt")]
SHORT_CASES += [("llama-gqa", EvictionConfig(policy="h2o", hh_size=4, recent_size=2, sink_size=1), SHORT, SHORT_NEW),
                ("opt", EvictionConfig(policy="h2o-port", hh_size=4, recent_size=3), SHORT, SHORT_NEW),
                ("llama-gqa", EvictionConfig(policy="h2o-avg", hh_size=6, recent_size=1), SHORT, SHORT_NEW),
                ("llama-gqa", EvictionConfig(policy="h2o", hh_size=6, recent_size=1, score_reduce="mean"), SHORT,
                 SHORT_NEW)]


def case_id(case) -> str:
    kind, ev, lengths, _ = case
    return f"{kind}-{ev.policy}-h{ev.hh_size}r{ev.recent_size}s{ev.sink_size}-{ev.score_reduce}-p{max(lengths)}"


@pytest.mark.parametrize("kind,ev,lengths,n_new", CASES + SHORT_CASES, ids=[case_id(c) for c in CASES + SHORT_CASES])
def test_matches_engine_and_reference(kind, ev, lengths, n_new):
    model = h2o_model(kind)
    prompts = random_prompts(lengths)
    cache = H2OCache(ev)
    tokens, logits = hf_generate(model, prompts, cache, n_new)
    engine, out = run_engine(model, prompts, ev, n_new)
    trace: list = []
    ref_tokens, ref_logits = run_reference(model, prompts, ev, n_new, trace=trace)
    # three fp32 orders of one run (HF's attention, the reference's, the engine's): see same_run
    whole = [a == b == n_new for a, b in zip(same_run(model, tokens, ref_tokens, logits, ref_logits),
                                                 same_run(model, out.token_ids, tokens, engine.step_logits, logits))]
    kept = cache.kept_positions()
    assert any(whole), "every sequence split at a near tie: nothing left to compare the kept positions of"
    for i in (i for i, w in enumerate(whole) if w):              # a run split at a near tie keeps other tokens
        assert [x[i] for x in kept] == [x[i] for x in engine_kept(engine)] == [x[i] for x in trace[-1]], i
    # eviction really happened: every column holds exactly the budget, and no padding (positions are >= 0)
    budget = ev.resolve(max(lengths), n_new).budget
    assert all(len(col) == budget and min(col) >= 0 for layer in kept for seq in layer for col in seq)


@pytest.mark.parametrize("kind,ev,lengths,n_new", SHORT_CASES, ids=[case_id(c) for c in SHORT_CASES])
def test_short_cases_depend_on_decode_scores(kind, ev, lengths, n_new, monkeypatch):
    """Guard for the comparison above: freezing the scores after the prompt changes what these cases keep."""
    model = h2o_model(kind)
    prompts = random_prompts(lengths)
    live = H2OCache(ev)
    hf_generate(model, prompts, live, n_new)
    commit = H2OLayer.commit_decode
    monkeypatch.setattr(H2OLayer, "commit_decode", lambda self, mass: commit(self, None))
    frozen = H2OCache(ev)
    hf_generate(model, prompts, frozen, n_new)
    assert frozen.kept_positions() != live.kept_positions()


def test_score_reduce_mean_divides_by_the_group():
    """mean and sum rank alike (equal group sizes), so only the stored scores can tell them apart."""
    model = h2o_model("llama-gqa")
    prompts = random_prompts(SHORT)
    mean, total = (H2OCache(hh_size=6, recent_size=1, score_reduce=r) for r in ("mean", "sum"))
    hf_generate(model, prompts, mean, SHORT_NEW)
    hf_generate(model, prompts, total, SHORT_NEW)
    for a, b in zip(mean.layers, total.layers):
        assert torch.equal(a.store.pos, b.store.pos)
        # 4 query / 2 KV heads: mean's mass is sum's halved, and halving is exact, so the running sums are too
        assert torch.equal(a.store.score * 2, b.store.score)


def test_eviction_changes_the_output():
    """The budgets above really bite: the same prompts without eviction give other tokens."""
    model = h2o_model("llama-gqa")
    prompts = random_prompts(LENGTHS)
    evicted, _ = hf_generate(model, prompts, H2OCache(H2O))
    full, _ = hf_generate(model, prompts, DynamicCache())
    assert not torch.equal(evicted, full)


def test_ratios_resolve_against_the_padded_prompt():
    """H2OCache sees the left-padded batch transformers hands it, so its ratios are of the padded length: the
    engine's run at those counts in slots gives the same tokens and kept positions. (The engine's own ratios are
    each sequence's: docs/hf.md says how the two differ.)"""
    model = h2o_model("llama-gqa")
    prompts = random_prompts(LENGTHS)
    ev = EvictionConfig(policy="h2o", hh_ratio=0.2, recent_ratio=0.15, sink_size=1)
    cache = H2OCache(ev)
    tokens, logits = hf_generate(model, prompts, cache)
    assert (cache.budget.sink, cache.budget.heavy, cache.budget.recent) == (1, 4, 3)   # int(0.2 * 24), int(0.15 * 24)
    engine, out = run_engine(model, prompts, EvictionConfig(policy="h2o", hh_size=4, recent_size=3, sink_size=1))
    assert [t.tolist() for t in tokens] == out.token_ids
    assert cache.kept_positions() == engine_kept(engine)
    per_sequence, _ = run_engine(model, prompts, ev)
    short = LENGTHS.index(min(LENGTHS))          # its own 20 % / 15 % are fewer slots than the padded length's
    assert {len(c) for layer in engine_kept(per_sequence) for c in layer[short]} == \
        {1 + int(0.2 * min(LENGTHS)) + int(0.15 * min(LENGTHS))}


# --- 2. a budget that covers the run is DynamicCache ---

@pytest.mark.parametrize("policy", ["h2o", "h2o-port", "h2o-avg", "local", "sink", "random"])
@pytest.mark.parametrize("kind", ["llama-mha", "llama-gqa", "opt"])
def test_covering_budget_equals_dynamic_cache(kind, policy):
    model = h2o_model(kind)
    covering = dict(policy=policy, kv_budget=max(LENGTHS) + N_NEW)
    # equal lengths: the slots hold the tokens in DynamicCache's order. Told the run length, the cache knows
    # nothing will be evicted (as the engine does) and skips scoring: bit-identical logits
    prompts = random_prompts([24, 24, 24])
    want_tokens, want_logits = hf_generate(model, prompts, DynamicCache())
    cache = H2OCache(**covering, max_new_tokens=N_NEW)
    tokens, logits = hf_generate(model, prompts, cache)
    assert torch.equal(tokens, want_tokens)
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert cache.layers[0].store.capacity == 24 + N_NEW
    # padded batches (pads are packed out of the slots, which changes the fp32 summation order), and runs
    # whose length the cache is not told (the prompt is scored with an unfused softmax): the same tokens
    prompts = random_prompts(LENGTHS)
    want_tokens, want_logits = hf_generate(model, prompts, DynamicCache())
    for cache in (H2OCache(**covering, max_new_tokens=N_NEW), H2OCache(**covering)):
        tokens, logits = hf_generate(model, prompts, cache)
        same_run(model, tokens, want_tokens, logits, want_logits)


def test_dynamic_cache_with_h2o_attention_equals_sdpa():
    """The registered attention is plain causal attention for any other cache."""
    model = tiny_hf("llama-gqa")
    prompts = random_prompts(LENGTHS)
    want_tokens, want_logits = hf_generate(model, prompts, DynamicCache())          # sdpa
    enable_h2o(model)
    tokens, logits = hf_generate(model, prompts, DynamicCache())
    same_run(model, tokens, want_tokens, logits, want_logits)                 # sdpa's order and ours


# --- 3. fixed memory ---

class Recorder(LogitsProcessor):
    """Called once per generated token: records what the cache holds at that moment."""

    def __init__(self, cache: H2OCache):
        self.cache, self.rows = cache, []

    def __call__(self, input_ids, scores):
        c = self.cache
        self.rows.append((c.nbytes, tuple(l.store.k.data_ptr() for l in c.layers),
                          max(int((l.store.pos >= 0).sum(-1).max()) for l in c.layers)))
        return scores


def test_cache_bytes_constant_over_256_decode_steps():
    model = h2o_model("llama-gqa")
    prompts = random_prompts([24, 13])
    cache = H2OCache(H2O_SINK)
    rec = Recorder(cache)
    tokens, _ = hf_generate(model, prompts, cache, n_new=257, logits_processor=LogitsProcessorList([rec]))
    assert tokens.shape == (2, 257) and len(rec.rows) == 257         # prefill + 256 decode steps
    budget = H2O_SINK.resolve(24, 257).budget
    cfg = model.config
    g, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    # per layer: K and V fp32 + fp32 score + int32 position, for budget + 1 slots per (sequence, KV head)
    expected = cfg.num_hidden_layers * 2 * g * (budget + 1) * (2 * d * 4 + 4 + 4)
    assert {row[0] for row in rec.rows} == {expected}                 # same bytes at every step
    assert len({row[1] for row in rec.rows}) == 1                     # same buffers: never reallocated
    assert all(row[2] == budget for row in rec.rows)                  # full from the prompt on, never over
    # the point of it: DynamicCache holds every token (fp32 K and V only) after the same run
    dyn = DynamicCache()
    hf_generate(model, prompts, dyn, n_new=257)
    dyn_bytes = sum(l.keys.nbytes + l.values.nbytes for l in dyn.layers)
    assert dyn_bytes == cfg.num_hidden_layers * 2 * g * (24 + 256) * 2 * d * 4
    assert expected * 10 < dyn_bytes


# --- 4. chunked prompt scoring, padding ---

def test_prompt_scores_are_computed_in_query_chunks(monkeypatch):
    """H2OCache's query_chunk sizes the torch path's scored blocks (ops.grouped_attention; the compiled kernel
    keeps its own blocks), which the HF path reaches through the engine's Kernels.prompt_attention."""
    from flexgen_h2o.models import ops
    seen = []
    real = ops.score_blocking

    def spy(batch, heads, keys, queries, query_chunk, cap):
        rows, chunk = real(batch, heads, keys, queries, query_chunk, cap)
        if queries > 1:                                  # the prompt; a decode step has one query
            seen.append((queries, chunk))
        return rows, chunk

    model = h2o_model("llama-gqa")
    prompts = random_prompts(LENGTHS)
    big = H2OCache(H2O_SINK)
    big.kernels = ops.TORCH
    want_tokens, want_logits = hf_generate(model, prompts, big)
    monkeypatch.setattr(ops, "score_blocking", spy)
    small = H2OCache(H2O_SINK, query_chunk=5)
    small.kernels = ops.TORCH
    tokens, logits = hf_generate(model, prompts, small)
    # 24-token prompt, 2 layers: blocks of 5 queries
    assert seen == [(24, 5)] * 2
    if same_run(model, tokens, want_tokens, logits, want_logits) == [N_NEW] * len(prompts):
        assert small.kept_positions() == big.kept_positions()


def test_padding_content_changes_nothing():
    """Pads are never attended or kept: filling them with other token ids leaves every real result unchanged."""
    model = h2o_model("llama-gqa")
    prompts = random_prompts(LENGTHS)
    ids, mask = left_padded(model, prompts)
    runs = []
    for pad_ids in (ids, torch.where(mask.bool(), ids, torch.randint(3, 100, ids.shape))):
        cache = H2OCache(H2O_SINK)
        with torch.no_grad():
            out = model.generate(pad_ids, attention_mask=mask, cache=cache, max_new_tokens=N_NEW,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                                 eos_token_id=None)
        runs.append((out, cache))
    (a, ca), (b, cb) = runs
    assert torch.equal(a.sequences[:, ids.shape[1]:], b.sequences[:, ids.shape[1]:])
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    for la, lb in zip(ca.layers, cb.layers):
        assert torch.equal(la.store.pos, lb.store.pos) and torch.equal(la.store.score, lb.store.score)


def test_prompt_attention_matches_eager_probabilities():
    """The scores are the eager attention probabilities, summed over the real queries and a KV head's query
    heads (mean: divided by the group size), whatever the padding pattern and the chunk size."""
    from flexgen_h2o.hf import prompt_attention
    torch.manual_seed(0)
    b, h, g, t, d = 2, 6, 2, 11, 8
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, g, t, d), torch.randn(b, g, t, d)
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[0, :3] = False                          # left padding
    valid[1, 4:6] = False                         # a hole in the middle: pad queries see real keys
    kr, vr = k.repeat_interleave(h // g, dim=1), v.repeat_interleave(h // g, dim=1)
    allowed = torch.ones(t, t, dtype=torch.bool).tril() & valid[:, None, None, :]
    allowed |= torch.eye(t, dtype=torch.bool)
    probs = torch.softmax((q @ kr.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf")), dim=-1)
    want_out = probs @ vr
    want_sum = (probs * valid[:, None, :, None]).sum(2).view(b, g, h // g, t).sum(2)
    # chunked and whole: two fp32 orders, within tolerances.attention_bounds (mean: one division more)
    out_bound, score_bound = attention_bounds(q, k, v, allowed, 0.3, valid)
    for chunk in (1, 4, 64):
        out, scores = prompt_attention(q, k, v, valid, 0.3, want_scores=True, chunk=chunk)
        assert_within(out, want_out, out_bound, f"out, chunk {chunk}")
        assert_within(scores, want_sum, score_bound, f"scores, chunk {chunk}")
        _, mean = prompt_attention(q, k, v, valid, 0.3, want_scores=True, chunk=chunk, score_reduce="mean")
        assert_within(mean, want_sum / (h // g), score_bound / (h // g) * (1 + 2 * EPS32), f"mean, chunk {chunk}")
    # the check has teeth: counting the pad queries of the middle hole would change the real keys' scores
    every_query = probs.sum(2).view(b, g, h // g, t).sum(2)
    assert not torch.allclose(every_query[1, :, :4], want_sum[1, :, :4], atol=1e-3)


# --- compressed KV (kv_bits): the reference's rows read back through quantization ---

def first_flips(quant_log: dict, rows: list, mask: torch.Tensor, bits: int) -> tuple[list[int], float]:
    """Per sequence, the first decode step that reads a K or V row whose quantized form differs between the HF
    path and the reference (N_NEW: none), and the largest difference of their quantizer inputs.

    Both quantize with the same torch ops (fake_quant is GroupQuant's math), so the HF cache's codes are
    fake_quant of its own inputs (captured), on any CPU. Their inputs differ by the two paths' fp32 rounding
    (another attention order), so a code may differ, but only for a value near a rounding boundary: asserted
    per row, the reference's margin (fake_quant's, in the quantizer's input units) under 2 delta + 8 EPS32
    max|x|, delta the row's input difference: the value moves by delta, the group's min and (max - min) /
    levels * levels by 2 delta at most, and each path's (x - min) / step rounds twice (relative EPS32 of
    |x - min| <= 2 max|x|)."""
    p = mask.shape[1]
    real = torch.cat([mask.bool(), torch.ones(mask.shape[0], N_NEW, dtype=torch.bool)], 1)[:, None, :, None]
    first, delta = [N_NEW] * mask.shape[0], 0.0
    for layer, (ref_k, ref_v, ref_scale, _) in sorted(quant_log.items()):
        n = ref_k.shape[2] - 1                            # the newest row is read unrounded
        live = real[:, :, :n]
        hf_k, hf_v = (torch.cat([r[i] for r in rows[layer]], dim=2)[:, :, :n] for i in (0, 1))
        # the channel scale as both caches take it: max |k| over the real prompt rows
        hf_scale = torch.where(live[:, :, :p], hf_k[:, :, :p].abs(), 0).amax(2, keepdim=True).clamp(min=1e-30)
        for hf_x, ref_x in ((hf_k / hf_scale, ref_k[:, :, :n] / ref_scale), (hf_v, ref_v[:, :, :n])):
            margins: list = []
            flipped = (fake_quant(hf_x, bits, 64) != fake_quant(ref_x, bits, 64, margins)).any(-1) & live[..., 0]
            diff = torch.where(live, hf_x - ref_x, 0).abs()
            delta = max(delta, float(diff.max()))
            bound = 2 * diff.amax(-1) + 8 * EPS32 * ref_x.abs().amax(-1)
            assert bool((margins[0][flipped] <= bound[flipped]).all()), f"layer {layer}: a far value rounded apart"
            for b, _, i in flipped.nonzero().tolist():
                first[b] = min(first[b], max(1, i - p + 2))        # row i is first read rounded at that step
    return first, delta


@pytest.mark.parametrize("kind, bits", [("llama-gqa", 4), ("opt", 8)])
def test_compressed_cache_matches_the_engine_and_the_reference(kind, bits, monkeypatch):
    from flexgen_h2o.config import OffloadPolicy
    model = h2o_model(kind)
    prompts = random_prompts(LENGTHS, seed=SEED)
    cache = H2OCache(H2O_SINK, kv_bits=bits)
    rows: list = []                           # per layer: the K, V rows the HF cache is given (its quantizer's inputs)
    update = H2OLayer.update

    def spy(layer, k, v, *a, **kw):
        i = cache.layers.index(layer) if layer in cache.layers else len(cache.layers)
        rows.extend([] for _ in range(i + 1 - len(rows)))
        rows[i].append((k.clone(), v.clone()))
        return update(layer, k, v, *a, **kw)

    monkeypatch.setattr(H2OLayer, "update", spy)
    tokens, logits = hf_generate(model, prompts, cache)
    monkeypatch.setattr(H2OLayer, "update", update)
    quant_log: dict = {}
    ref_tokens, ref_logits = quantized_reference(model, prompts, H2O_SINK, (bits, 64), quant_log=quant_log)
    first, delta = first_flips(quant_log, rows, left_padded(model, prompts)[1], bits)
    # the inputs differ by fp32 rounding only (a few dozen ulps of |K| / scale <= 1, |V| <= 3: a fan-in of 64
    # rounding in two orders, 2 gamma(64) <= 8e-6 relative), not by a wrong scale or row
    assert delta <= 2 * gamma(64) * 4, delta
    spy = EngineQuantInputs(monkeypatch)
    engine, out = run_engine(model, prompts, H2O_SINK, offload=OffloadPolicy(kv_bits=bits, gpu_batch_size=8))
    monkeypatch.undo()
    try:
        mask = left_padded(model, prompts)[1]
        # the engine is a third rounding order: its own codes against the reference's, the same rule
        first_engine, engine_delta = first_flipped_step(spy.by_layer(engine), reference_inputs(quant_log, mask),
                                                        list(LENGTHS), bits, N_NEW)
        assert engine_delta <= 2 * gamma(64) * 4, engine_delta
        for i, (n, n_engine) in enumerate(zip(first, first_engine)):
            # before a flip the codes are equal and the runs differ by fp32 orders only: tokens equal but at a
            # near tie, logits within tolerances.logit_bound (x100 over what any CPU showed, under one code's
            # effect). From the flip on the runs read different (equally right) roundings: nothing is compared
            want = [l[i] for l in ref_logits]
            bound = logit_bound(model, torch.stack(want))
            n = greedy_agreement(tokens[i, :n].tolist(), ref_tokens[i, :n].tolist(), want, bound, f"hf {i}")
            assert max_logit_diff([l[i] for l in logits[:n]], want[:n]) <= bound, i
            greedy_agreement(out.token_ids[i][:n_engine], ref_tokens[i, :n_engine].tolist(), want, bound,
                             f"engine {i}")
        # the comparison has teeth: most steps are strict (a flip needs a value within ~1e-6 of a boundary)
        assert sum(first) >= 0.5 * N_NEW * len(prompts), first
        assert sum(first_engine) >= 0.5 * N_NEW * len(prompts), first_engine
        kept, engine_kept_now = cache.kept_positions(), engine_kept(engine)
        for i in (i for i in range(len(prompts)) if first[i] == first_engine[i] == N_NEW):
            assert [layer[i] for layer in kept] == [layer[i] for layer in engine_kept_now], f"sequence {i}"
        assert cache.layers[0].store.k.dtype == torch.uint8
    finally:
        engine.close()
