"""scripts/heavy_hitters.py: prompt segments, the kept set it classifies (the engine's own), the per-query-mean
counterfactual, and one small run on the real SmolLM2 weights."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from flexgen_h2o.config import GenerationConfig
from flexgen_h2o.eval import data
from flexgen_h2o.frontends.corpus import lee_articles
from flexgen_h2o.kv import Budget, get_policy

SPEC = importlib.util.spec_from_file_location("heavy_hitters",
                                              Path(__file__).parents[2] / "scripts" / "heavy_hitters.py")
hh = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(hh)
T, D, S, O, R = hh.TEMPLATE, hh.DEMO_DOC, hh.DEMO_SUM, hh.OPENING, hh.DOC_REST



def test_prompt_pieces_are_the_harness_prompt_with_its_examples_labelled(tok):
    """The pieces come from the harness's own format and the item's examples: joined, they are the prompt."""
    articles = lee_articles()
    for item in data.summary_items(tok, 3, 600):
        pieces = hh.prompt_pieces(item)
        assert data.encode(tok, "".join(t for t, _ in pieces)) == item.prompt
        shots = [data.split_lead(articles[i]) for i in item.shot_articles]
        assert len(shots) == item.shots >= 1
        assert [t for t, s in pieces if s == D] == [rest for _, rest in shots]
        assert [t for t, s in pieces if s == S] == [lead for lead, _ in shots]
        assert [t for t, s in pieces if s == R] == [data.split_lead(articles[item.article])[1]]


def test_token_segments_put_merged_tokens_after_the_cut(tok):
    pieces = [("Article: ", T), ("The cat sat.", D), ("\nSummary: ", T), ("A cat.", S), ("\n\nArticle:", T)]
    ids = data.encode(tok, "".join(t for t, _ in pieces))
    words = [tok.decode([i]) for i in ids]
    assert words[:3] == ["Article", ":", " The"]                     # the space merged into the document's word
    segs = hh.token_segments(tok, pieces, ids)
    assert segs[:12] == [T, T, D, D, D, D, T, T, T, S, S, S] and set(segs[12:]) == {T}
    assert "".join(w for w, s in zip(words, segs) if s == S) == " A cat."
    assert hh.mark_opening([T, R, R, R, T], 2) == [T, O, O, R, T]
    with pytest.raises(RuntimeError, match="do not tokenize"):
        hh.token_segments(tok, pieces, ids[:-1])


def test_real_items_segment_back_into_their_texts(tok):
    for item in data.summary_items(tok, 2, 320):
        segs = hh.item_segments(tok, item, opening=16)
        _, rest = data.split_lead(lee_articles()[item.article])
        doc = [i for i, s in zip(item.prompt, segs) if s in (O, R)]
        assert tok.decode(doc) == " " + rest                         # the target document, every token of it
        assert segs.count(O) == 16 and segs.index(O) < segs.index(R)
        assert item.shots >= 1 and D in segs and S in segs


def test_segment_counts_classify_a_known_kept_set():
    seg = torch.tensor([[-1, T, D, D, S, O, R, R]])                  # a left pad first
    heavy = torch.tensor([[[0, 1, 1, 0, 1, 1, 0, 0], [1, 0, 1, 1, 0, 0, 0, 1]]], dtype=torch.bool)
    counts = hh.segment_counts(heavy, seg)                           # pads count nowhere
    assert counts.tolist() == [[[1, 1, 1, 1, 0], [2, 0, 0, 0, 1]]]
    out = hh.summarize(counts.numpy()[:, None], np.array([[2.0, 1, 1, 1, 2]]), np.array([[[0.5, 0.0]]]),
                       np.array([False]))
    # head 0 shares: 1/4 each of four segments; head 1: 2/3 demo_doc, 1/3 doc_rest
    assert out["heavy_share"]["demo_doc"] == pytest.approx((0.25 + 2 / 3) / 2)
    assert out["heavy_share"]["doc_rest"] == pytest.approx(1 / 6)
    assert sum(out["heavy_share"].values()) == pytest.approx(1.0)
    assert out["keep_rate"]["demo_doc"] == pytest.approx(3 / 4)       # 3 heavy of 2 tokens x 2 heads
    assert out["keep_rate"]["doc_opening"] == pytest.approx(1 / 2)
    assert out["opening_kept"]["longer"] == {"n": 1, "kept": 0.25} and out["opening_kept"]["fits"]["kept"] is None


def test_average_ranking_moves_heavy_hitters_late():
    # positions 0..7 after one pad; the sum favours 0 and 1, the average (score / (8 - j)) 5 (0.6) and 4 (0.55)
    score = torch.tensor([[[0.0, 4.0, 2.8, 1.8, 1.0, 2.2, 1.8, 0.5, 0.3]]])
    pos = torch.tensor([[-1, 0, 1, 2, 3, 4, 5, 6, 7]])
    budget = Budget(sink=0, heavy=2, recent=2)
    policy = get_policy("h2o")
    kept, heavy, recent = hh.select(policy, score, pos, budget)
    assert pos[0][heavy[0, 0]].tolist() == [0, 1] and pos[0][recent[0, 0]].tolist() == [6, 7]
    assert kept.sum() == 4
    _, heavy, _ = hh.select(get_policy("h2o-avg"), score, pos, budget)
    assert pos[0][heavy[0, 0]].tolist() == [4, 5]
    # a column within its budget keeps everything and has no heavy hitters
    kept, heavy, _ = hh.select(policy, score, pos, Budget(sink=0, heavy=4, recent=4))
    assert kept.sum() == 8 and heavy.sum() == 0


@pytest.mark.slow
def test_small_run_classifies_what_the_engine_keeps():
    from flexgen_h2o.eval.grid import GridPoint, parse_budget
    from flexgen_h2o.eval.runner import Runner
    from flexgen_h2o.loader import load_model
    from flexgen_h2o.weights import WeightStoreError
    try:
        loaded = load_model("smollm2-135m", progress=False)
    except (WeightStoreError, ImportError) as e:
        pytest.skip(f"SmolLM2 weights unavailable: {e}")
    items = data.summary_items(loaded.tokenizer, 2, 320)
    budget = parse_budget("64")
    with Runner(loaded, batch_size=2, progress=False) as runner:
        out = hh.measure(runner, loaded.tokenizer, items, budget, [None, 0.25], gen_len=8, opening=32,
                         progress=False)
        # the engine's own cache after a prefilled decode start holds exactly the set the script classified
        pre = runner.engine.prefill([it.prompt for it in items])
        for name in hh.RANKINGS:
            ev = GridPoint(name, budget).eviction(1)
            runner.engine.generate([it.prompt for it in items], GenerationConfig(max_new_tokens=1, stop_at_eos=False),
                                   eviction=ev, prefilled=pre)
            for layer, (_, _, score, pos) in pre[0].layers[0].items():
                cache_pos = runner.engine.last_caches[0][layer].snapshot()[3]
                kept, _, _ = hh.select(get_policy(name), score, pos, ev.resolve(pos.shape[1], 1))
                for b in range(2):
                    for g in range(kept.shape[1]):
                        want = sorted(pos[b][kept[b, g]].tolist())
                        assert len(want) == 64 and sorted(p for p in cache_pos[b, g].tolist() if p >= 0) == want
    for label, heavy in (("even", 32), ("heavy 0.25", 16)):
        for ranking in hh.RANKINGS:
            r = out["results"][label][ranking]
            assert sum(r["heavy_share"].values()) == pytest.approx(1.0)
            assert r["heavy_slots_per_column"] == heavy                # every column evicts at 64 slots
            assert r["slots"]["heavy"] == [heavy, heavy] and r["slots"]["recent"] == [64 - heavy, 64 - heavy]
            assert len(r["per_layer_heavy_share"]) == loaded.config.n_layers
            assert 0 <= r["opening_kept"]["all"]["kept"] <= 1
    assert [it["tokens"]["doc_opening"] for it in out["items"]] == [32, 32]
    lengths = [it["prompt_len"] for it in out["items"]]
    assert lengths == sorted(lengths) == sorted(len(it.prompt) for it in items)    # the harness's block order
    md = hh.render({**out, "meta": {"model": "m", "items": 2, "prompt_len": 320, "gen_len": 8, "budget": "64",
                                    "batch_size": 2, "opening": 32, "command": "x"}})
    assert "| 29 |" in md
    assert f"Mean prompt: {sum(lengths) / 2:.0f} tokens" in md and "doc_opening 32," in md

