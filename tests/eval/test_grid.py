"""Grid parsing and the EvictionConfig each point gives the engine."""
from __future__ import annotations

import pytest

from flexgen_h2o.config import ConfigError
from flexgen_h2o.eval.grid import DEFAULT_BUDGETS, GridPoint, make_grid, parse_budget, parse_budgets, parse_policies


def test_default_grid_matches_the_issue():
    budgets = parse_budgets(",".join(DEFAULT_BUDGETS))
    assert [b.label for b in budgets] == ["5%", "10%", "20%", "40%", "64", "128", "256", "512", "1024"]
    grid = make_grid(parse_policies("full,h2o,h2o-port,local,sink,random"), budgets)
    assert grid[0].key == "full" and len(grid) == 1 + 5 * 9
    assert len({p.key for p in grid}) == len(grid)


@pytest.mark.parametrize("text,slots", [("20%", 410), ("5%", 102), ("256", 256), ("100%", 2048)])
def test_budget_slots(text, slots):
    assert parse_budget(text).slots_for(2048) == slots


@pytest.mark.parametrize("policy", ["h2o", "h2o-port", "h2o-avg", "local", "sink", "random"])
def test_every_policy_gets_the_same_total(policy):
    ev = GridPoint(policy, parse_budget("20%")).eviction(1000)
    budget = ev.resolve(990, 10)
    assert budget.budget == 200 and budget.evicts


def test_full_and_rolling_points():
    ev = GridPoint("full").eviction(100)
    assert ev.policy == "full" and ev.kv_budget is None
    point = GridPoint("sink", parse_budget("64"), rolling=True)
    assert point.key == "sink@64+roll" and point.eviction(10_000).position_rolling


def test_sink_budget_is_raised_to_hold_its_sinks():
    assert GridPoint("sink", parse_budget("1%")).slots(100) == 5
    GridPoint("sink", parse_budget("1%")).eviction(100).resolve(90, 10)      # valid, no ValueError


@pytest.mark.parametrize("text,match", [("0%", "in \\(0, 100\\]"), ("abc", "neither"), ("0", ">= 1"),
                                        ("20%,20%", "repeats"), ("", "empty")])
def test_bad_budgets(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_budgets(text)


def test_bad_policies():
    with pytest.raises(ConfigError, match="unknown policy lru"):
        parse_policies("h2o,lru")


@pytest.mark.parametrize("policy", ["h2o", "h2o-port", "h2o-avg"])
def test_heavy_share_moves_slots_from_heavy_to_recent_at_the_same_total(policy):
    even = GridPoint(policy, parse_budget("20%")).eviction(1000).resolve(990, 10)
    quarter = make_grid([policy], [parse_budget("20%")], heavy_share=0.25)[0].eviction(1000).resolve(990, 10)
    assert (even.heavy, even.recent) == (100, 100)
    assert (quarter.heavy, quarter.recent) == (50, 150) and quarter.budget == even.budget == 200


def test_heavy_share_leaves_the_window_policies_alone():
    for policy in ("local", "sink", "random"):
        a = GridPoint(policy, parse_budget("20%")).eviction(1000).resolve(990, 10)
        b = GridPoint(policy, parse_budget("20%"), heavy_share=0.1).eviction(1000).resolve(990, 10)
        assert a == b
