"""Real weights: SmolLM2-135M-Instruct (Llama, GQA 9 query / 3 KV heads) with H2OCache in transformers'
`generate`, on a left-padded batch of two chat prompts, against the engine's H2O and the masked reference."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from flexgen_h2o.config import GenerationConfig
from flexgen_h2o.hf import H2OCache, enable_h2o
from flexgen_h2o.kv import EvictionConfig
from tests.helpers import engine_kept, loaded_engine
from tests.reference.compare import assert_same_as_reference, left_padded, same_run
from tests.reference.h2o_masked import reference_generate

pytestmark = pytest.mark.slow
N_NEW = 24


@pytest.fixture
def smol(smollm2):
    """tests/conftest.py's SmolLM2, its transformers model switched to the flexgen_h2o attention for the test."""
    loaded, model, prompts = smollm2
    before = model.config._attn_implementation
    enable_h2o(model)
    yield smollm2
    model.set_attn_implementation(before)


def hf_generate(model, ids, mask, cache, n_new=N_NEW):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=2, eos_token_id=None)
    return out.sequences[:, ids.shape[1]:], [l.float() for l in out.logits]


def test_smollm2_h2o_cache_matches_engine_and_reference(smol):
    loaded, model, prompts = smol
    ids, mask = left_padded(model, prompts)
    assert int(mask.sum(1).min()) < ids.shape[1]                       # the batch really is padded
    ev = EvictionConfig(policy="h2o", hh_size=12, recent_size=8, sink_size=2)
    cache = H2OCache(ev)
    tokens, logits = hf_generate(model, ids, mask, cache)
    engine = loaded_engine(loaded, ev)
    out = engine.generate(prompts, GenerationConfig(max_new_tokens=N_NEW, stop_at_eos=False))
    evd: dict = {}
    ref_tokens, ref_logits = reference_generate(model, ids, mask, budget=(2, 12, 8), rule="exact",
                                                max_new_tokens=N_NEW, eviction=evd)
    assert model.config._attn_implementation == "flexgen_h2o"         # the reference restored it
    # three fp32 orders of one eviction rule (HF's attention, the engine's, the reference's): each against the
    # reference as test_h2o_engine holds the engine to it, up to the reference's first eviction at a near tie
    hf = SimpleNamespace(step_logits={i: [l[i] for l in logits] for i in range(len(prompts))})
    whole = set(assert_same_as_reference(model, hf, SimpleNamespace(token_ids=tokens.tolist()), ref_tokens,
                                         ref_logits, evd))
    whole &= set(assert_same_as_reference(model, engine, out, ref_tokens, ref_logits, evd))
    # kept positions of the sequences no near tie split (one that was keeps, rightly, other tokens)
    assert [[x[i] for i in whole] for x in cache.kept_positions()] == [[x[i] for i in whole]
                                                                       for x in engine_kept(engine)]
    # 22 slots per (sequence, KV head) in each of the 30 layers, whatever the prompt length
    assert {layer.store.k.shape for layer in cache.layers} == {(2, 3, 23, 64)}
    assert len(cache.layers) == 30


def test_smollm2_covering_budget_equals_dynamic_cache(smol):
    _, model, prompts = smol
    ids, mask = left_padded(model, prompts)
    want_tokens, want_logits = hf_generate(model, ids, mask, DynamicCache())
    tokens, logits = hf_generate(model, ids, mask, H2OCache(kv_budget=ids.shape[1] + N_NEW))
    # padded: the slots pack the pads out, another fp32 order than sdpa's (as test_hf_h2o's covering case)
    same_run(model, tokens, want_tokens, logits, want_logits)
