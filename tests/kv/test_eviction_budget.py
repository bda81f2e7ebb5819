"""EvictionConfig -> Budget: the slot counts each flag means, validation messages, and the startup line."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.kv import Budget, EvictionConfig, describe, describe_rows


def test_hh_ratio_follows_the_port():
    b = EvictionConfig("h2o", hh_ratio=0.1).resolve(512, 32)
    assert (b.sink, b.heavy, b.recent) == (0, 51, 51)           # int(0.1 * 512) heavy, recent mirrors it
    assert b.budget == 102 and b.capacity == 103


def test_port_recent_is_heavy_minus_one():
    b = EvictionConfig("h2o-port", hh_ratio=0.1).resolve(512, 32)
    assert (b.heavy, b.recent) == (51, 50)
    assert b.capacity == 2 * 51                                  # the port's fixed 2 * hh_k rows


def test_sizes_override_ratios_and_recent_ratio():
    assert EvictionConfig("h2o", hh_ratio=0.1, recent_ratio=0.2).resolve(100, 8).recent == 20
    b = EvictionConfig("h2o", hh_ratio=0.1, hh_size=7, recent_ratio=0.5, recent_size=3).resolve(100, 8)
    assert (b.heavy, b.recent) == (7, 3)
    b = EvictionConfig("h2o", hh_size=7).resolve(100, 8)
    assert (b.heavy, b.recent) == (7, 7)
    assert EvictionConfig("h2o-port", hh_size=7).resolve(100, 8).recent == 6


def test_sinks_are_extra_slots_but_come_out_of_kv_budget():
    b = EvictionConfig("h2o", hh_size=10, recent_size=10, sink_size=4).resolve(100, 8)
    assert (b.sink, b.heavy, b.recent, b.budget) == (4, 10, 10, 24)
    b = EvictionConfig("h2o", kv_budget=100, sink_size=4).resolve(512, 32)
    assert (b.sink, b.heavy, b.recent, b.budget) == (4, 48, 48, 100)
    b = EvictionConfig("h2o", kv_budget=101).resolve(512, 32)
    assert (b.heavy, b.recent) == (50, 51)


def test_window_policies_get_the_heavy_share_as_window():
    b = EvictionConfig("local", hh_ratio=0.1).resolve(512, 32)
    assert (b.sink, b.heavy, b.recent) == (0, 0, 102)
    b = EvictionConfig("sink", hh_ratio=0.1).resolve(512, 32)
    assert (b.sink, b.heavy, b.recent) == (4, 0, 102)            # StreamingLLM's 4 sinks by default
    b = EvictionConfig("sink", kv_budget=100).resolve(512, 32)
    assert (b.sink, b.heavy, b.recent, b.budget) == (4, 0, 96, 100)
    b = EvictionConfig("random", hh_ratio=0.1).resolve(512, 32)
    assert (b.heavy, b.recent) == (51, 51)


def test_full_and_capacity_cap():
    b = EvictionConfig("full").resolve(512, 32)
    assert b.capacity == 544 and not b.evicts
    b = EvictionConfig("h2o", hh_ratio=1.0).resolve(512, 32)
    assert b.budget == 1024 and b.capacity == 544 and not b.evicts  # never more slots than tokens
    assert EvictionConfig("h2o", hh_ratio=0.1).resolve(512, 32).evicts


def test_edge_budgets_allowed():
    b = EvictionConfig("h2o", hh_size=0, recent_size=8).resolve(100, 8)
    assert (b.heavy, b.recent) == (0, 8)
    b = EvictionConfig("h2o", hh_size=8, recent_size=0).resolve(100, 8)
    assert (b.heavy, b.recent) == (8, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="h2o", hh_ratio=0.0), r"hh_ratio .* \(0, 1\]"),
    (dict(policy="h2o", hh_ratio=1.5), r"hh_ratio .* \(0, 1\]"),
    (dict(policy="h2o", hh_ratio=0.1, recent_ratio=-0.1), r"recent_ratio .* \(0, 1\]"),
    (dict(policy="lru"), "unknown eviction policy 'lru'"),
    (dict(policy="h2o", hh_ratio=0.1, score_reduce="max"), "score_reduce"),
    (dict(policy="h2o", hh_size=-1), "hh_size .* >= 0"),
    (dict(policy="h2o", kv_budget=0), "kv_budget .* >= 1"),
    (dict(policy="h2o", kv_budget=64, hh_ratio=0.1), "do not combine it with hh_ratio"),
    (dict(policy="full", hh_ratio=0.1), "'full' keeps every token"),
    (dict(policy="h2o"), "needs a budget"),
    (dict(policy="local", hh_ratio=0.1, sink_size=4), "use policy 'sink'"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvictionConfig(**kwargs)


def test_resolve_errors():
    with pytest.raises(ValueError, match="h2o-port needs at least one heavy hitter"):
        EvictionConfig("h2o-port", hh_ratio=0.001).resolve(100, 8)
    with pytest.raises(ValueError, match="budget is 0 slots"):
        EvictionConfig("h2o", hh_ratio=0.001).resolve(100, 8)
    with pytest.raises(ValueError, match="smaller than the 4 sink tokens"):
        EvictionConfig("sink", kv_budget=3).resolve(100, 8)
    with pytest.raises(ValueError, match="prompt_len >= 1"):
        EvictionConfig("h2o", hh_ratio=0.1).resolve(0, 8)


def test_describe_line():
    per_token = 10.2e9 / 544
    line = describe(EvictionConfig("h2o", hh_ratio=0.1).resolve(512, 32), 512, 32, per_token)
    assert line == "KV cache: h2o, 102 slots/seq (51 heavy + 51 recent) = 18.8% of 512+32; 1.9 GB instead of 10.2 GB"
    line = describe(EvictionConfig("sink", kv_budget=100).resolve(512, 32), 512, 32, per_token)
    assert line.startswith("KV cache: sink, 100 slots/seq (4 sink + 96 recent) = 18.4% of 512+32")
    assert describe(EvictionConfig("full").resolve(512, 32), 512, 32, per_token) == \
        "KV cache: full, 544 slots/seq (512+32); 10.2 GB"
    assert describe(EvictionConfig("h2o-avg", kv_budget=100).resolve(512, 32), 512, 32, per_token).startswith(
        "KV cache: h2o-avg, 100 slots/seq (50 heavy + 50 recent)")
    assert "nothing is evicted" in describe(Budget(0, 40, 40, max_tokens=40), 30, 10, 1000)


def test_ratio_budgets_are_per_sequence():
    """Each row's budget comes from its own length (the H2O HF code's semantics); the port's from the block's
    longest. A block allocates its largest capacity."""
    rows = EvictionConfig("h2o", hh_ratio=0.2).resolve_rows([20, 40, 7], [16, 16, 16])
    assert [(r.heavy, r.recent) for r in rows.rows] == [(4, 4), (8, 8), (1, 1)]
    assert rows.capacity == 17 and all(r.evicts for r in rows.rows)
    assert rows.values("budget") == [8, 16, 2]
    port = EvictionConfig("h2o-port", hh_ratio=0.2).resolve_rows([20, 40, 7], [16, 4, 8])
    assert {(r.heavy, r.recent, r.max_tokens) for r in port.rows} == {(8, 7, 56)}
    # sizes do not depend on the length; a short prompt's whole run can fit its budget (then it never evicts)
    sizes = EvictionConfig("h2o", hh_size=6, recent_size=4).resolve_rows([30, 5], [8, 3])
    assert [r.budget for r in sizes.rows] == [10, 10] and [r.evicts for r in sizes.rows] == [True, False]
    assert sizes.capacity == 11
    with pytest.raises(ValueError, match="budget is 0 slots for prompt_len 4"):
        EvictionConfig("h2o", hh_ratio=0.2).resolve_rows([20, 4], [8, 8])


def test_row_budgets_give_columns():
    rows = EvictionConfig("h2o", hh_ratio=0.2, sink_size=1).resolve_rows([20, 40], [8, 8])
    like = torch.zeros(2, 3, 5)
    assert rows.col("recent", like).shape == (2, 1, 1) and rows.col("recent", like).flatten().tolist() == [4, 8]
    assert rows.col("budget", like[..., 0]).flatten().tolist() == [9, 17] and rows.sink == 1
    same = EvictionConfig("h2o", hh_size=3, recent_size=2).resolve_rows([20, 40], [8, 8])
    assert same.col("budget", like) == 5                 # rows that agree give a plain int (no tensor per step)
    assert rows.part(1, 2).values("heavy") == [8]


def test_describe_rows_gives_the_range():
    per_token = 1e6
    ev = EvictionConfig("h2o", hh_ratio=0.2)
    budgets = [ev.resolve(n, 16) for n in (105, 510, 300)]
    line = describe_rows(budgets, [105, 510, 300], [16, 16, 16], per_token)
    assert line.startswith("KV cache: h2o, 42-204 slots/seq (21-102 heavy + 21-102 recent; from each prompt's own "
                           "length) = 34.7-38.8% of prompt + new tokens; up to 205.0 MB instead of 526.0 MB"), line
    port = EvictionConfig("h2o-port", hh_ratio=0.2)
    assert "from the block's longest prompt" in describe_rows([port.resolve(510, 16), port.resolve(300, 16)],
                                                              [510, 300], [16, 16], per_token)
    same = [ev.resolve(512, 32)] * 2
    assert describe_rows(same, [512, 512], [32, 32], per_token) == describe(same[0], 512, 32, per_token)


def test_generator_only_for_random_and_seeded():
    assert EvictionConfig("h2o", hh_ratio=0.1).generator() is None
    g1, g2 = EvictionConfig("random", hh_ratio=0.1, seed=3).generator(), EvictionConfig(
        "random", hh_ratio=0.1, seed=3).generator()
    assert torch.equal(torch.rand(5, generator=g1), torch.rand(5, generator=g2))
