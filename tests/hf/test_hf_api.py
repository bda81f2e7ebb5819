"""H2OCache's surface: how it is switched on, what it rejects (one clear line each), beam search, half
precision, and what it refuses to pretend (rollback, multi-token steps)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from flexgen_h2o.hf import ATTN_NAME, H2OCache, enable_h2o
from flexgen_h2o.kv import EvictionConfig
from tests.helpers import random_prompts, tiny_hf
from tests.reference.compare import left_padded

LENGTHS = [20, 13, 24]


def generate(model, prompts, cache, n_new=8, **kw):
    ids, mask = left_padded(model, prompts)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=n_new,
                              min_new_tokens=n_new, do_sample=False, pad_token_id=model.config.pad_token_id,
                              eos_token_id=None, **kw)[:, ids.shape[1]:]


@pytest.mark.parametrize("kwargs,message", [
    (dict(hh_sise=4), "unknown H2OCache option"),
    (dict(eviction=EvictionConfig(policy="h2o", hh_size=4), hh_size=4), "not both"),
    (dict(policy="h2o"), "needs a budget"),
    (dict(policy="nope", hh_size=4), "unknown eviction policy"),
    (dict(hh_size=4, position_rolling=True), "position_rolling"),
    (dict(policy="full"), "max_new_tokens"),
    (dict(hh_size=4, max_new_tokens=0), "max_new_tokens must be"),
    (dict(hh_size=4, query_chunk=0), "query_chunk"),
    (dict(hh_ratio=1.5), "hh_ratio"),
])
def test_bad_options_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        H2OCache(**kwargs)


def test_without_the_attention_function_it_refuses_to_run():
    model = tiny_hf("llama-gqa")                         # sdpa: never reports attention mass
    with pytest.raises(RuntimeError, match="attn_implementation='flexgen_h2o'"):
        generate(model, random_prompts(LENGTHS), H2OCache(hh_size=4, recent_size=4))


def test_from_pretrained_with_attn_implementation(tmp_path):
    tiny_hf("llama-gqa").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTN_NAME, dtype=torch.float32)
    assert model.config._attn_implementation == ATTN_NAME
    want = generate(enable_h2o(tiny_hf("llama-gqa")), random_prompts(LENGTHS), H2OCache(hh_size=4, recent_size=3))
    assert torch.equal(generate(model, random_prompts(LENGTHS), H2OCache(hh_size=4, recent_size=3)), want)


def test_enable_h2o_rejects_models_without_the_attention_interface():
    class Legacy(torch.nn.Module):
        _supports_attention_backend = False
    with pytest.raises(ValueError, match="AttentionInterface"):
        enable_h2o(Legacy())


def test_no_rollback_and_one_token_per_step():
    model = enable_h2o(tiny_hf("llama-gqa"))
    cache = H2OCache(hh_size=4, recent_size=3)
    ids, mask = left_padded(model, random_prompts(LENGTHS))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache)
        with pytest.raises(NotImplementedError, match="one token per step"):
            model(input_ids=ids[:, :2], attention_mask=torch.cat([mask, mask[:, :2]], 1), cache=cache)
    with pytest.raises(NotImplementedError, match="roll back"):
        cache.crop(-1)
    assert not cache.is_croppable and not cache.is_compileable


def test_runs_past_max_new_tokens_fail_clearly():
    model = enable_h2o(tiny_hf("llama-gqa"))
    cache = H2OCache(policy="full", max_new_tokens=4)
    with pytest.raises(RuntimeError, match="max_new_tokens=4"):
        generate(model, random_prompts(LENGTHS), cache, n_new=8)


def test_4d_masks_are_rejected():
    model = enable_h2o(tiny_hf("llama-gqa"))
    ids = torch.tensor([random_prompts([6])[0]])
    mask4d = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with torch.no_grad(), pytest.raises(ValueError, match="2D attention_mask"):
        model(input_ids=ids, attention_mask=mask4d, cache=H2OCache(hh_size=2, recent_size=2))


def test_training_mode_dropout_is_rejected():
    model = enable_h2o(tiny_hf("llama-gqa"))
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="inference only"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


def test_beam_search():
    model = enable_h2o(tiny_hf("llama-gqa"))
    prompts = random_prompts(LENGTHS)
    beams = dict(num_beams=3)
    # covering budget: beam search over H2OCache is beam search over DynamicCache
    want = generate(model, prompts, DynamicCache(), **beams)
    assert torch.equal(generate(model, prompts, H2OCache(kv_budget=64, max_new_tokens=8), **beams), want)
    # a tight budget: beams are reordered inside the same fixed buffers
    cache = H2OCache(hh_size=3, recent_size=3)
    out = generate(model, prompts, cache, **beams)
    assert out.shape == (3, 8) and not torch.equal(out, want)
    assert {layer.store.k.shape for layer in cache.layers} == {(9, 2, 7, 16)}     # 3 prompts x 3 beams, 6 + 1 slots


def test_half_precision_keeps_fp32_scores():
    model = enable_h2o(tiny_hf("llama-gqa").to(torch.bfloat16))
    prompts = random_prompts(LENGTHS)
    cache = H2OCache(hh_size=4, recent_size=3)
    generate(model, prompts, cache)
    layer = cache.layers[0].store
    assert layer.k.dtype == layer.v.dtype == torch.bfloat16 and layer.score.dtype == torch.float32
    assert float(layer.score.sum()) > 0
    want = generate(model, prompts, DynamicCache())
    assert torch.equal(generate(model, prompts, H2OCache(kv_budget=64, max_new_tokens=8)), want)


def test_cache_can_be_reset_and_reused():
    model = enable_h2o(tiny_hf("opt"))
    prompts = random_prompts(LENGTHS)
    cache = H2OCache(hh_ratio=0.2)
    first = generate(model, prompts, cache)
    cache.reset()
    assert cache.budget is None and cache.nbytes == 0
    assert torch.equal(generate(model, prompts, cache), first)


def test_llama_like_models_and_sliding_windows():
    from transformers import MistralConfig, MistralForCausalLM
    shape = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(**shape, sliding_window=8))
    with pytest.raises(ValueError, match="sliding-window"):
        enable_h2o(windowed)
    model = MistralForCausalLM(MistralConfig(**shape, sliding_window=None)).eval()
    prompts = random_prompts(LENGTHS)
    want = generate(model, prompts, DynamicCache())
    enable_h2o(model)
    assert torch.equal(generate(model, prompts, H2OCache(kv_budget=64)), want)
    assert not torch.equal(generate(model, prompts, H2OCache(hh_size=2, recent_size=2)), want)
