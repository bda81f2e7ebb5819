"""The harness on tiny random models: its perplexity is transformers' perplexity, a budget that holds the whole
sequence is the full cache bit for bit, eviction really happens below it, and teacher-forced exact match is
what greedy decoding produces."""
from __future__ import annotations

import math

import pytest
import torch

from flexgen_h2o.config import ConfigError, GenerationConfig
from flexgen_h2o.eval.grid import GridPoint, parse_budget
from flexgen_h2o.eval.perplexity import perplexity, summarize_scores
from flexgen_h2o.eval.runner import Runner
from flexgen_h2o.loader import LoadedModel
from tests.helpers import random_prompts, tiny_hf, weight_reader

POLICIES = ["h2o", "h2o-port", "h2o-avg", "local", "sink", "random"]


def runner_for(model, **kw) -> Runner:
    cfg, read = weight_reader(model)
    kw.setdefault("kv_dtype", "float32")
    return Runner(LoadedModel(cfg, read, None, None), progress=False, **kw)


@pytest.fixture(scope="module")
def llama():
    return tiny_hf("llama-gqa")


@pytest.fixture(scope="module")
def items():
    # equal lengths (as the perplexity task cuts them) and a second block of a different length
    return random_prompts([24, 24, 24, 19]), random_prompts([12, 12, 12, 12], seed=7)


def hf_nll(model, prompt, cont) -> list[float]:
    ids = torch.tensor([prompt + cont])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:len(prompt) + len(cont) - 1].float()
    logp = torch.log_softmax(logits, -1)
    return [-float(logp[i, t]) for i, t in enumerate(cont)]


@pytest.mark.parametrize("kind", ["llama-gqa", "opt"])
def test_full_cache_perplexity_is_transformers_perplexity(kind, items):
    model = tiny_hf(kind)
    prompts, conts = items
    with runner_for(model, batch_size=3) as runner:
        scored, info = runner.score(GridPoint("full"), prompts, conts)
    assert len(info.slots) == 2                                  # two blocks of 3 and 1
    ref = [hf_nll(model, p, c) for p, c in zip(prompts, conts)]
    for ours, theirs in zip(scored, ref):
        assert max(abs(a - b) for a, b in zip(ours.nll, theirs)) < 1e-4
    ppl = summarize_scores(scored)["ppl"]
    assert math.isclose(ppl, perplexity([x for r in ref for x in r]), rel_tol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_holding_the_sequence_equals_full_exactly(llama, items, policy):
    prompts, conts = items
    seq_len = max(map(len, prompts)) + len(conts[0])
    with runner_for(llama, batch_size=4) as runner:
        full, _ = runner.score(GridPoint("full"), prompts, conts)
        for budget in ("100%", str(seq_len), "4096"):
            got, info = runner.score(GridPoint(policy, parse_budget(budget)), prompts, conts)
            assert [s.nll for s in got] == [s.nll for s in full], budget       # bit-identical
            assert info.as_dict()["blocks_evicting"] == 0
        # one slot fewer than the sequence: the engine really evicts (and the harness records it)
        _, info = runner.score(GridPoint(policy, parse_budget(str(seq_len - 1))), prompts, conts)
        assert info.as_dict()["blocks_evicting"] == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_small_budget_changes_the_logits(llama, items, policy):
    """Eviction is real: a 25 % cache gives other numbers than the full cache (no claim on which is better)."""
    prompts, conts = items
    with runner_for(llama, batch_size=4) as runner:
        full, _ = runner.score(GridPoint("full"), prompts, conts)
        small, info = runner.score(GridPoint(policy, parse_budget("25%")), prompts, conts)
    assert info.slots == [9]
    assert [s.nll for s in small] != [s.nll for s in full]


def test_teacher_forced_exact_match_is_greedy_decoding(llama, items):
    """needle's `exact` = every forced token was the argmax; forcing the greedy output must give all hits."""
    prompts, _ = items
    point = GridPoint("h2o", parse_budget("30%"))
    with runner_for(llama, batch_size=4) as runner:
        greedy, _, _ = runner.generate(point, prompts, GenerationConfig(max_new_tokens=8, stop_at_eos=False))
        scored, _ = runner.score(point, prompts, greedy)
    assert all(all(s.hit) for s in scored)


def test_random_policy_is_seeded(llama, items):
    prompts, conts = items
    point = GridPoint("random", parse_budget("30%"))
    runs = []
    for seed in (0, 0, 1):
        with runner_for(llama, batch_size=4, seed=seed) as runner:
            runs.append([s.nll for s in runner.score(point, prompts, conts)[0]])
    assert runs[0] == runs[1] != runs[2]


def test_streaming_runs_past_the_window_only_when_lifted():
    model = tiny_hf("llama-gqa")                      # window (max_position_embeddings) 512
    prompt, cont = random_prompts([40]), random_prompts([480], seed=3)
    with runner_for(model, batch_size=1) as runner:
        with pytest.raises(ConfigError, match="context window"):
            runner.score(GridPoint("h2o", parse_budget("32")), prompt, cont)
    with runner_for(model, batch_size=1, lift_window=True) as runner:
        for point in (GridPoint("full"), GridPoint("h2o", parse_budget("32")),
                      GridPoint("h2o", parse_budget("32"), rolling=True)):
            scored, _ = runner.score(point, prompt, cont)
            assert len(scored[0].nll) == 480 and all(math.isfinite(x) for x in scored[0].nll)


def test_rolling_needs_rope_and_lifting_needs_rope():
    with pytest.raises(ConfigError, match="learned positions"):
        runner_for(tiny_hf("opt"), lift_window=True)
    with runner_for(tiny_hf("opt")) as runner:
        with pytest.raises(ConfigError, match="RoPE"):
            runner.score(GridPoint("h2o", parse_budget("8"), rolling=True), [[3, 4, 5]], [[6, 7]])


def test_bad_items():
    with runner_for(tiny_hf("opt")) as runner:
        with pytest.raises(ConfigError, match="at least one token"):
            runner.score(GridPoint("full"), [[3, 4]], [[]])
        with pytest.raises(ConfigError, match="1 prompts but 2"):
            runner.score(GridPoint("full"), [[3, 4]], [[5], [6]])


class DictCheckpoint:
    def __init__(self):
        self.saved: dict[tuple[str, int], dict] = {}

    def get(self, key, block):
        return self.saved.get((key, block))

    def put(self, key, block, value):
        self.saved[(key, block)] = value


def test_grid_shares_one_prefill_per_block_and_resumes(llama, items, monkeypatch):
    prompts, conts = items
    points = [GridPoint("full"), GridPoint("h2o", parse_budget("30%")), GridPoint("sink", parse_budget("12")),
              GridPoint("h2o", parse_budget("30%"), rolling=True), GridPoint("snapkv", parse_budget("30%")),
              GridPoint("tova", parse_budget("30%"))]
    with runner_for(llama, batch_size=3) as runner:
        calls = []
        real = runner.engine.prefill
        monkeypatch.setattr(runner.engine, "prefill", lambda p, rolling=False, score_window=None:
                            calls.append((rolling, score_window)) or real(p, rolling, score_window))
        ckpt = DictCheckpoint()
        grid = runner.score_grid(points, prompts, conts, ckpt)
        # 2 blocks x (plain, rolling, snapkv's window of 32, tova's last query), not 2 x 6 points
        per_block = [(False, None), (True, None), (False, 32), (False, 1)]
        assert calls == per_block * 2
        alone = {p.key: runner.score(p, prompts, conts)[0] for p in points}
        for p in points:
            assert [s.nll for s in grid[p.key][0]] == [s.nll for s in alone[p.key]], p.key
            assert grid[p.key][1].as_dict()["blocks"] == 2
        # a run killed after block 0: only block 1 is computed again, and the results are the same
        calls.clear()
        partial = DictCheckpoint()
        partial.saved = {k: v for k, v in ckpt.saved.items() if k[1] == 0}
        resumed = runner.score_grid(points, prompts, conts, partial)
        assert calls == per_block
        assert {k: [s.nll for s in v[0]] for k, v in resumed.items()} == \
            {k: [s.nll for s in v[0]] for k, v in grid.items()}
