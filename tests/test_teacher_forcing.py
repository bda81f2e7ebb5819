"""Teacher forcing (Engine.generate(forced=...)), what the accuracy harness scores: the fed-back tokens are the
forced ones, and with a full cache each step's logits equal transformers' logits over prompt + continuation."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.config import ConfigError
from tests.helpers import greedy, make_engine, random_prompts, tiny_hf
from tests.tolerances import assert_within, logit_bound


@pytest.mark.parametrize("kind", ["opt", "llama-gqa"])
def test_forced_logits_match_transformers_full_sequence(kind):
    model = tiny_hf(kind)
    engine = make_engine(model)
    prompts = random_prompts([7, 11, 4])
    forced = random_prompts([6, 6, 6], seed=5)
    result = engine.generate(prompts, greedy(6), forced=forced)
    assert result.token_ids == forced
    for s, (p, f) in enumerate(zip(prompts, forced)):
        ids = torch.tensor([p + f])
        with torch.no_grad():
            ref = model(ids).logits[0, len(p) - 1:len(p) + len(f) - 1]
        ours = torch.stack(engine.step_logits[s])
        # two fp32 orders (the compiled kernels, transformers' GEMMs): the model's derived logit bound
        assert_within(ours, ref, logit_bound(model, ref), f"sequence {s}")


def test_forced_must_cover_every_prompt():
    engine = make_engine(tiny_hf("opt"))
    with pytest.raises(ConfigError, match="forced has 1 continuations for 2 prompts"):
        engine.generate(random_prompts([3, 4]), greedy(2), forced=[[5, 6]])


def test_negative_entries_sample_and_the_rest_is_forced():
    model = tiny_hf("llama-gqa")
    prompts = random_prompts([9, 5])
    free = make_engine(model).generate(prompts, greedy(5)).token_ids
    forced = [[-1, -1, 7, -1, 9], [-1]]
    out = make_engine(model).generate(prompts, greedy(5), forced=forced).token_ids
    assert out[0][:2] == free[0][:2] and out[0][2] == 7 and out[0][4] == 9
    assert out[1] == free[1]                                  # all sampled: the free run


def test_end_entry_finishes_a_sequence_and_the_block_stops_when_all_are_done():
    from flexgen_h2o.engine import END, SAMPLE
    engine = make_engine(tiny_hf("opt"))
    out = engine.generate(random_prompts([6, 4]), greedy(50), forced=[[5, SAMPLE, END], [8, 9, 10, END]])
    assert len(out.token_ids[0]) == 2 and out.token_ids[0][0] == 5
    assert out.token_ids[1] == [8, 9, 10]
    assert out.finish_reasons == ["length", "length"]
    assert out.metrics["decode_steps"] == 3                   # stopped at step 3, not after 50 tokens
