"""The engine (or another path) against the masked reference of tests/reference/h2o_masked.py, on the shapes the
engine tests share: left-padded prompts, the reference run with the engine's own budgets, and the comparison that
holds two fp32 orders of one eviction rule to each other (tests/tolerances.py). Also the placements of the KV that
those tests run, and the caches of a finished run."""
from __future__ import annotations

import torch

from flexgen_h2o.kv import EvictionConfig
from tests.helpers import (assert_scores_close, engine_kept, engine_scores, greedy, make_engine, max_logit_diff,
                           random_prompts, tiny_hf)
from tests.reference.h2o_masked import RULE_FOR_POLICY, reference_generate
from tests.tolerances import eviction_tie_step, greedy_agreement, logit_bound, score_rel_bound

LENGTHS = [20, 13, 24]           # every prompt is longer than the tests' budgets: eviction starts in the prefill
N_NEW = 16
SEED = 1                         # random_prompts' seed of the compressed-KV runs (tests/test_compressed_kv.py)
# the KV's tiers besides the compute one, as OffloadPolicy fields
PLACEMENTS = {"host": dict(cache_gpu_pct=0, cache_cpu_pct=100), "disk": dict(cache_gpu_pct=0, cache_cpu_pct=0),
              "mixed": dict(cache_gpu_pct=34, cache_cpu_pct=33)}


def left_padded(model, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch for transformers: (input ids, attention mask)."""
    pad = model.config.pad_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def run_reference(model, prompts, ev: EvictionConfig, n_new: int = N_NEW, trace=None, scores=None, eviction=None):
    ids, mask = left_padded(model, prompts)
    # each sequence's own budget (h2o-port: the block's, from the padded length), as the engine resolves them
    budgets = [ev.resolve(ids.shape[1] if ev.per_block else len(p), n_new) for p in prompts]
    return reference_generate(model, ids, mask, budgets, rule=RULE_FOR_POLICY[ev.policy], max_new_tokens=n_new,
                              score_reduce=ev.score_reduce, trace=trace, rolling=ev.position_rolling,
                              scores=scores, eviction=eviction, score_window=ev.score_window,
                              pool_kernel=ev.pool_kernel or 1, head_floor=budgets[0].head_floor)


def reference_prompt_kept(model, prompts, ev: EvictionConfig) -> list:
    """The positions the reference's prompt pass keeps under `ev`, [layer][b][g] (a short run: 2 new tokens)."""
    trace: list = []
    run_reference(model, prompts, ev, n_new=2, trace=trace)
    return trace[0]


def quantized_reference(model, prompts, ev: EvictionConfig, kv_bits, near_ties: list | None = None,
                        quant_log=None):
    """The reference with its KV quantized as the engine's compressed cache stores it (kv_bits: (bits, group))."""
    ids, mask = left_padded(model, prompts)
    budgets = [ev.resolve(len(p), N_NEW) for p in prompts]
    return reference_generate(model, ids, mask, budgets, rule=RULE_FOR_POLICY[ev.policy], max_new_tokens=N_NEW,
                              rolling=ev.position_rolling, kv_bits=kv_bits, near_ties=near_ties,
                              quant_log=quant_log, score_window=ev.score_window, pool_kernel=ev.pool_kernel or 1,
                              head_floor=budgets[0].head_floor)


def run_engine(model, prompts, ev, n_new: int = N_NEW, **kw):
    engine = make_engine(model, eviction=ev, **kw)
    out = engine.generate(prompts, greedy(n_new))
    return engine, out


def all_caches(engine) -> list:
    """Every KV cache of the engine's last run, across GPU batches, layers and tiers."""
    return [c for caches in engine.last_caches for split in caches.values() for c in split.caches]


def score_bound(model, ref_tokens, evd: dict) -> float:
    """tolerances.score_rel_bound for a reference run: keys up to the padded prompt plus the run, terms (queries
    x the group's heads) as many."""
    cfg = model.config
    n_keys = evd["width"] + ref_tokens.shape[1]                 # every key a run may hold
    r = cfg.num_attention_heads // getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    return score_rel_bound(model, evd["attn_mag"], n_keys, n_keys * r)


def assert_same_as_reference(model, engine, out, ref_tokens, ref_logits, evd: dict | None = None) -> list[int]:
    """The engine against the masked reference: two fp32 orders (compiled kernels and MKL/oneDNN against HF's
    eager attention), so per sequence tokens equal but at a near tie (greedy_agreement), logits within
    tolerances.logit_bound up to there, and, given the reference's eviction record evd, only up to its first
    eviction at a near tie (tolerances.eviction_tie_step). Returns the sequences compared over the whole run."""
    n_new = ref_tokens.shape[1]
    ties = [n_new] * ref_tokens.shape[0]
    if evd:
        ties = eviction_tie_step(evd["gaps"], score_bound(model, ref_tokens, evd), n_new, "reference")
    whole = []
    for i in range(ref_tokens.shape[0]):
        assert len(engine.step_logits[i]) == len(ref_logits)
        want = [l[i] for l in ref_logits]
        bound = logit_bound(model, torch.stack(want))
        n = greedy_agreement(out.token_ids[i][:ties[i]], ref_tokens[i, :ties[i]].tolist(), want, bound,
                             f"sequence {i}")
        assert max_logit_diff(engine.step_logits[i][:n], want[:n]) <= bound, f"sequence {i}"
        if n == n_new:
            whole.append(i)
    return whole


def same_run(model, tokens, want_tokens, logits, want_logits) -> list[int]:
    """Two fp32 orders of one greedy run (tokens (b, n) or lists, logits per step (b, V) or per sequence lists):
    per sequence, tokens equal but at a near tie of want's logits and logits within tolerances.logit_bound up to
    there; returns per sequence the steps compared (all of them unless a near tie split the runs)."""
    steps = []
    for i in range(len(want_tokens)):
        got = [l[i] for l in logits] if isinstance(logits[0], torch.Tensor) and logits[0].dim() == 2 else logits[i]
        want = [l[i] for l in want_logits] if want_logits[0].dim() == 2 else want_logits[i]
        bound = logit_bound(model, torch.stack(want))
        n = greedy_agreement(list(map(int, tokens[i])), list(map(int, want_tokens[i])), want, bound, f"sequence {i}")
        assert max_logit_diff(got[:n], want[:n]) <= bound, f"sequence {i}"
        steps.append(n)
    return steps


def check_against_reference(kind: str, ev: EvictionConfig, inspect=None, **engine_kw) -> list:
    """Engine and reference on the same padded prompts: tokens, logits and kept positions agree.
    Returns the reference's trace of kept positions (prefill first, then after each step). inspect(engine), if
    given, runs on the engine after its run, before it closes."""
    model = tiny_hf(kind)
    prompts = random_prompts(LENGTHS)
    engine, out = run_engine(model, prompts, ev, **engine_kw)
    try:
        if inspect is not None:
            inspect(engine)
        trace: list = []
        scores: list = []
        evd: dict = {}
        ref_tokens, ref_logits = run_reference(model, prompts, ev, trace=trace, scores=scores, eviction=evd)
        whole = assert_same_as_reference(model, engine, out, ref_tokens, ref_logits, evd)
        # kept positions and scores of the runs no near tie split (one that was keeps, rightly, other tokens)
        kept, want = engine_kept(engine), trace[-1]
        assert [[x[i] for i in whole] for x in kept] == [[x[i] for i in whole] for x in want]
        if ev.needs_scores:                   # the caches' own score and position tensors, not only tokens
            assert_scores_close(engine_scores(engine), scores, score_bound(model, ref_tokens, evd), whole)
    finally:
        engine.close()
    return trace


def check_hf_cache(kind: str, cache, ev: EvictionConfig) -> list:
    """H2OCache `cache` in transformers' generate on the shared left-padded prompts keeps the engine's tokens and
    kept slots under `ev` (the same rule), for every sequence no near tie split. Returns the cache's kept
    positions [layer][b][g]."""
    from flexgen_h2o.hf import enable_h2o
    model = enable_h2o(tiny_hf(kind))
    prompts = random_prompts(LENGTHS)
    ids, mask = left_padded(model, prompts)
    with torch.no_grad():
        res = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.pad_token_id, eos_token_id=None)
    tokens, logits = res.sequences[:, ids.shape[1]:], [l.float() for l in res.logits]
    engine, out = run_engine(model, prompts, ev)
    try:
        steps = same_run(model, out.token_ids, tokens, engine.step_logits, logits)
        whole = [i for i, n in enumerate(steps) if n == N_NEW]
        assert whole, "every sequence split at a near tie: no kept slots left to compare"
        kept, want = cache.kept_positions(), engine_kept(engine)
        assert [[x[i] for i in whole] for x in kept] == [[x[i] for i in whole] for x in want]
    finally:
        engine.close()
    return kept
