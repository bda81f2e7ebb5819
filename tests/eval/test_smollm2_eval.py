"""The harness on the real SmolLM2 weights and real text (slow: real weights, a grid point a run)."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_h2o.eval import data
from flexgen_h2o.eval.grid import GridPoint, parse_budget
from flexgen_h2o.eval.perplexity import perplexity, summarize_scores
from flexgen_h2o.eval.runner import Runner

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(smollm2):
    """tests/conftest.py's SmolLM2 (its store and transformers model) and two Wikipedia items of 96 + 24 tokens."""
    loaded, model, _ = smollm2
    return loaded, model, data.perplexity_items(loaded.tokenizer, "wiki", 2, 96, 24)


def test_full_cache_perplexity_equals_transformers_on_wikipedia(smol):
    loaded, model, items = smol
    with Runner(loaded, batch_size=2, kv_dtype="float32", progress=False) as runner:
        scored, _ = runner.score(GridPoint("full"), [p for p, _ in items], [c for _, c in items])
    ref = []
    for p, c in items:
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:len(p) + len(c) - 1]
        logp = torch.log_softmax(logits.float(), -1)
        ref += [-float(logp[i, t]) for i, t in enumerate(c)]
    ours = summarize_scores(scored)["ppl"]
    assert math.isclose(ours, perplexity(ref), rel_tol=1e-4)
    assert 2 < ours < 200                         # real text on a real model, not a broken pipeline


def test_full_budget_equals_full_and_small_budget_evicts(smol):
    loaded, _, items = smol
    prompts, conts = [p for p, _ in items], [c for _, c in items]
    with Runner(loaded, batch_size=2, progress=False) as runner:            # fp16 KV, as a real run
        full, _ = runner.score(GridPoint("full"), prompts, conts)
        for policy in ("h2o", "sink"):
            same, info = runner.score(GridPoint(policy, parse_budget("100%")), prompts, conts)
            assert [s.nll for s in same] == [s.nll for s in full] and info.evicted == [False]
        small, info = runner.score(GridPoint("h2o", parse_budget("20%")), prompts, conts)
    assert info.evicted == [True] and info.slots == [24]
    assert [s.nll for s in small] != [s.nll for s in full]
    assert all(math.isfinite(x) for s in small for x in s.nll)
