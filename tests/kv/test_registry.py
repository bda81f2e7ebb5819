"""The policy registry (kv/registry.py): one PolicySpec line makes a rule known to budgets, the cache, the CLI
and the accuracy harness; the CLI reads it without importing torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from flexgen_h2o.eval.grid import parse_policies
from flexgen_h2o.frontends.cli import build_parser
from flexgen_h2o.kv import EvictionConfig, registry
from flexgen_h2o.kv.registry import PolicySpec, cli_policies, cli_variants, get_policy, policy_names, spec


def test_every_spec_loads_its_rule_with_the_spec_traits():
    assert policy_names() == ("full", "h2o", "h2o-port", "h2o-avg", "local", "sink", "random", "snapkv", "tova")
    for name in policy_names():
        p = get_policy(name)
        assert (p.name, p.needs_scores, p.compiled_rule) == (name, spec(name).needs_scores, spec(name).compiled_rule)
        assert callable(p.select_prefill) and callable(p.choose_victim)
    assert {n for n in policy_names() if spec(n).needs_scores} == {"h2o", "h2o-port", "h2o-avg", "snapkv", "tova"}
    assert get_policy("h2o") is get_policy("h2o")
    with pytest.raises(ValueError, match="unknown eviction policy 'quest'"):
        get_policy("quest")


def test_the_cli_choices_come_from_the_registry_without_torch():
    actions = {a.dest: a for a in build_parser()._actions}
    assert tuple(actions["policy"].choices) == cli_policies() == ("h2o", "local", "sink", "random", "snapkv", "tova")
    assert tuple(actions["h2o_variant"].choices) == ("exact", "port", "avg")
    assert cli_variants("h2o") == {"port": "h2o-port", "avg": "h2o-avg"}
    code = "import sys, flexgen_h2o.frontends.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_one_new_spec_reaches_budgets_the_cli_and_the_grid(monkeypatch):
    """A new scorer is its module plus one spec; here it borrows H2O's decisions."""
    new = PolicySpec("newrule", "h2o:H2OPolicy", needs_scores=True, compiled_rule=None)
    monkeypatch.setattr(registry, "SPECS", registry.SPECS + (new,))
    monkeypatch.setattr(registry, "_BY_NAME", {**registry._BY_NAME, "newrule": new})
    monkeypatch.setattr(registry, "_INSTANCES", {})
    ev = EvictionConfig(policy="newrule", hh_ratio=0.25)
    assert ev.needs_scores and ev.resolve(40, 8).budget == 20
    assert "newrule" in cli_policies() and parse_policies("full,newrule") == ["full", "newrule"]
    assert get_policy("newrule").name == "newrule" and get_policy("newrule").compiled_rule is None
    actions = {a.dest: a for a in build_parser()._actions}
    assert "newrule" in actions["policy"].choices


def test_traits_drive_the_budgets():
    assert EvictionConfig(policy="sink", kv_budget=20).resolve(100, 10).sink == 4          # default_sinks
    b = EvictionConfig(policy="local", kv_budget=20).resolve(100, 10)
    assert (b.heavy, b.recent) == (0, 20)                                                 # window_only
    assert EvictionConfig(policy="h2o-port", hh_ratio=0.1).per_block                      # per_block
    with pytest.raises(ValueError, match="h2o-port needs at least one heavy hitter"):    # min_heavy
        EvictionConfig(policy="h2o-port", hh_ratio=0.1).resolve(5, 4)
