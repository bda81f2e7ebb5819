"""Sampling (greedy, temperature, top-k, top-p, seeds) and per-sequence stop handling."""
from __future__ import annotations

import torch

from flexgen_h2o.config import GenerationConfig
from flexgen_h2o.sampling import Sampler, StopTracker
from tests.helpers import make_engine, random_prompts, tiny_hf


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    assert Sampler(GenerationConfig(), [0, 1])(logits).tolist() == [1, 0]


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    top_k = Sampler(GenerationConfig(temperature=1.0, top_k=2, seed=3), range(400))(logits)
    assert set(top_k.tolist()) == {0, 1}
    top_p = Sampler(GenerationConfig(temperature=1.0, top_p=0.7, seed=3), range(400))(logits)
    assert set(top_p.tolist()) == {0, 1}          # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the third token is cut
    free = Sampler(GenerationConfig(temperature=1.0, seed=3), range(400))(logits)
    assert set(free.tolist()) == {0, 1, 2, 3}


def test_seeded_sampling_is_reproducible_and_per_sequence():
    logits = torch.zeros(16, 50)              # uniform: 16 draws agreeing by chance has probability 50**-16
    a = Sampler(GenerationConfig(temperature=0.8, seed=7), range(16))(logits)
    b = Sampler(GenerationConfig(temperature=0.8, seed=7), range(16))(logits)
    c = Sampler(GenerationConfig(temperature=0.8, seed=8), range(16))(logits)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # a sequence draws from its own generator: its sample does not depend on its batch neighbours
    alone = Sampler(GenerationConfig(temperature=0.8, seed=7), range(16))(logits[2:3], rows=range(2, 3))
    assert alone.item() == a[2].item()


def test_stop_tracker_eos_stop_string_and_length():
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    gen = GenerationConfig(max_new_tokens=4, stop=("cd",))
    tracker = StopTracker(3, gen, eos_id=25, decode=decode, max_new=[4, 4, 2])
    for step in ([2, 25, 0], [3, 1, 0], [4, 1, 0]):
        tracker.update(step)
    tokens, texts, reasons = tracker.finish()
    assert reasons == ["stop", "eos", "length"]
    assert tokens == [[2, 3], [25], [0, 0]]
    assert texts == ["", "", "aa"]


def test_engine_sampling_is_seeded_and_stops_at_eos():
    model = tiny_hf("llama-gqa")
    prompts = random_prompts([5, 9])
    gen = GenerationConfig(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=11, stop_at_eos=False)
    one = make_engine(model, record=False).generate(prompts, gen).token_ids
    two = make_engine(model, record=False).generate(prompts, gen).token_ids
    assert one == two
    greedy = make_engine(model, record=False).generate(prompts, GenerationConfig(max_new_tokens=10,
                                                                                  stop_at_eos=False))
    assert one != greedy.token_ids
    # make the first greedy token of prompt 0 the EOS id: that sequence stops at once, the other goes on
    eos = greedy.token_ids[0][0]
    engine = make_engine(model, record=False)
    engine.model = engine.model.replace(eos_id=eos)
    out = engine.generate(prompts, GenerationConfig(max_new_tokens=10))
    assert out.finish_reasons[0] == "eos" and out.token_ids[0] == [eos]
    assert len(out.token_ids[1]) == 10 or out.finish_reasons[1] == "eos"
