"""scripts/rouge_gap.py: the per-article Rouge-2 and the paired bootstrap behind accuracy.md's reading of the
summarization miss."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("rouge_score")
SPEC = importlib.util.spec_from_file_location("rouge_gap", Path(__file__).parents[2] / "scripts" / "rouge_gap.py")
rouge_gap = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(rouge_gap)


def test_per_item_rouge2_scores_each_pair():
    scorer = rouge_gap.rouge_scorer()
    refs = ["the cat sat on the mat", "stocks fell sharply today", ""]
    preds = ["the cat sat on a mat", "rain is expected tomorrow", ""]
    r2 = rouge_gap.per_item_rouge2(scorer, refs, preds)
    assert r2[0] == pytest.approx(0.6)          # bigrams: 3 shared of 5 on each side
    assert r2[1] == 0.0
    assert r2[2] == 1.0                          # identical (empty) summaries count as a match


def test_bootstrap_interval_brackets_the_ratio_and_is_exact_for_a_scaled_copy():
    base = [0.0, 0.1, 0.0, 0.3, 0.05, 0.0, 0.2, 0.0, 0.15, 0.1]
    assert rouge_gap.bootstrap_ratio([2 * x for x in base], base, n=500) == pytest.approx((2.0, 2.0))
    other = [0.1, 0.0, 0.0, 0.1, 0.05, 0.1, 0.0, 0.0, 0.15, 0.0]
    lo, hi = rouge_gap.bootstrap_ratio(other, base, n=2000)
    ratio = sum(other) / sum(base)
    assert lo < ratio < hi and hi - lo > 0.2     # ten noisy articles: a wide interval, not a point


def test_recent_window_follows_the_grid_split():
    assert rouge_gap.recent_window("h2o", 410, None) == 205
    assert rouge_gap.recent_window("h2o", 409, None) == 205         # kv_budget's split: heavy = 409 // 2
    assert rouge_gap.recent_window("h2o", 410, 0.25) == 308
    assert rouge_gap.recent_window("sink", 410, 0.25) == 406       # 4 sinks, the rest recent; no heavy share
