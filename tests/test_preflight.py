"""Preflight: the per-tier estimate equals what the engine allocates, and runs that cannot fit are refused."""
from __future__ import annotations

import re

import pytest

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import PRESETS, from_hf_config
from flexgen_h2o.planner import Machine, PreflightError, checks, estimate, preflight
from tests.helpers import greedy, make_engine, random_prompts, tiny_hf
from tests.tiny_checkpoint import cli_env, run_main

GIB = 1 << 30

CASES = [
    ((100, 0, 100, 0, 100, 0), EvictionConfig(policy="full"), 3, 2, [20, 17, 13, 20, 9, 5]),
    ((0, 50, 30, 40, 0, 50), EvictionConfig(policy="h2o", hh_ratio=0.2), 4, 2, [20, 5, 13, 20, 9, 5, 7, 8]),
    ((50, 50, 0, 100, 100, 0), EvictionConfig(policy="h2o", hh_size=3, recent_size=2), 2, 3, [20, 11, 4]),
    ((0, 0, 0, 0, 0, 0), EvictionConfig(policy="sink", kv_budget=9), 2, 1, [20, 14]),
]


@pytest.mark.parametrize("percent, eviction, gbs, n_batches, lengths", CASES)
def test_estimate_matches_engine_allocation(tmp_path, percent, eviction, gbs, n_batches, lengths):
    model = tiny_hf("llama")
    cfg = from_hf_config(model.config.to_dict())
    offload = OffloadPolicy.from_percent(percent, gpu_batch_size=gbs, num_gpu_batches=n_batches)
    engine = make_engine(model, offload=offload, eviction=eviction, offload_dir=tmp_path, record=False)
    prompts = random_prompts(lengths)
    try:
        engine.generate(prompts, greedy(6))
        actual = {"compute": 0, "host": 0, "disk": 0}
        for caches in engine.last_caches:
            for split in caches.values():
                for _, _, cache in split.parts:
                    actual[cache.tier_kind] += cache.nbytes
        weights = engine.weights.summary()
    finally:
        engine.close()
    est = estimate(cfg, offload, eviction, prompt_len=max(lengths), gen_len=6, n_seqs=len(prompts),
                   compute_dtype_bytes=4)
    assert {t: est.bytes[t]["kv"] for t in actual} == actual          # the real H2O / full KV, per tier
    assert est.kv_bytes == sum(actual.values()) > 0
    # resident weights: fp16 matrices and fp32 vectors on the compute tier of a CPU, host fp16; disk-homed stay
    # in the store
    assert est.bytes["compute"]["weights"] == weights["compute"]
    assert est.bytes["host"]["weights"] == weights["host"]
    assert est.store_bytes == weights["disk"]


def test_h2o_estimate_is_smaller_than_full():
    cfg = PRESETS["opt-30b"]
    off = OffloadPolicy(gpu_batch_size=8, num_gpu_batches=4)
    full = estimate(cfg, off, EvictionConfig(), prompt_len=512, gen_len=32)
    h2o = estimate(cfg, off, EvictionConfig(policy="h2o", hh_ratio=0.1), prompt_len=512, gen_len=32)
    # 51 heavy + 51 recent + 1 current slot instead of 544 slots
    assert h2o.kv_bytes * 544 == full.kv_bytes * 103
    assert h2o.full_kv_bytes == full.full_kv_bytes == full.kv_bytes
    assert h2o.bytes["compute"]["weights"] == full.bytes["compute"]["weights"]


def test_fits_on_a_big_machine_and_not_on_a_small_one():
    cfg = PRESETS["opt-1.3b"]
    off, ev = OffloadPolicy(), EvictionConfig()
    kw = dict(prompt_len=512, gen_len=32)
    est, results = preflight(cfg, off, ev, machine=Machine(ram_available=64 * GIB, ram_total=64 * GIB), **kw)
    assert [c.resource for c in results] == ["RAM"] and results[0].ok
    with pytest.raises(PreflightError) as e:
        preflight(cfg, off, ev, machine=Machine(ram_available=2.5 * GIB, ram_total=8 * GIB), **kw)
    msg = str(e.value)
    assert "does not fit this machine (RAM)" in msg and "DOES NOT FIT" in msg
    need = float(re.search(r"RAM: need ([\d.]+) GiB of 2.50 GiB available", msg).group(1))
    assert need * GIB >= est.tier_total("compute") > 2.5 * GIB      # fp16 weights (2.45 GiB) and the full KV
    # each suggestion is one flag change whose own estimate fits the same machine. On a CPU host-homed weights
    # are fp16 like compute-homed ones, so moving them to the host tier would save nothing and is not offered
    tips = [line.strip() for line in msg.split("what to change (each alone fits):")[1].splitlines() if line.strip()]
    assert tips[0].startswith("--percent 0 0 100 0 100 0 (all weights streamed from disk)")
    assert not any(tip.startswith("--percent 0 100 100 0 100 0") for tip in tips)
    small = Machine(ram_available=2.5 * GIB, ram_total=8 * GIB)
    for tip in tips:
        fixed = OffloadPolicy.from_percent([float(x) for x in tip.split()[1:7]])
        assert all(c.ok for c in checks(estimate(cfg, fixed, ev, **kw), small))
    # and the refused estimate itself is over the limit
    assert not all(c.ok for c in checks(est, small))


def test_gpu_memory_checked_separately_from_ram():
    cfg = PRESETS["opt-6.7b"]
    machine = Machine(ram_available=64 * GIB, ram_total=64 * GIB, device_free=8 * GIB, device_total=16 * GIB)
    est = estimate(cfg, OffloadPolicy(), EvictionConfig(), prompt_len=512, gen_len=32, compute_dtype_bytes=2)
    gpu, ram = checks(est, machine)
    assert (gpu.resource, gpu.ok, ram.resource, ram.ok) == ("GPU memory", False, "RAM", True)
    assert gpu.parts["weights"] == pytest.approx(cfg.n_params() * 2, rel=1e-6)  # fp16 on the device


def test_disk_refusal_names_the_offload_dir(tmp_path):
    cfg = PRESETS["opt-175b"]
    off = OffloadPolicy.from_percent([0, 0, 0, 0, 100, 0], gpu_batch_size=64, num_gpu_batches=64)
    with pytest.raises(PreflightError) as e:     # ~20 TB of KV on disk
        preflight(cfg, off, EvictionConfig(), prompt_len=1024, gen_len=8, offload_root=tmp_path / "offload",
                  machine=Machine(ram_available=1 << 50, ram_total=1 << 50))
    assert f"disk ({tmp_path})" in str(e.value) and "DOES NOT FIT" in str(e.value)


def test_cli_refuses_a_run_that_cannot_fit(tmp_path):
    env = cli_env(tmp_path / "home")
    proc = run_main(["--model", "opt-175b", "--dummy-weights", "--percent", "0", "100", "100", "0", "100", "0",
                     "--gpu-batch-size", "64", "--num-gpu-batches", "64", "--prompt-len", "1024", "--gen-len", "8",
                     "--metrics-json", str(tmp_path / "m.json")], env)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert err.startswith("preflight: opt-175b does not fit this machine (RAM)")
    m = re.search(r"RAM: need ([\d.]+) GiB of ([\d.]+) GiB available  \[weights ([\d.]+) GiB, kv ([\d.]+) GiB", err)
    assert m and float(m.group(1)) > float(m.group(2))
    assert float(m.group(3)) == pytest.approx(PRESETS["opt-175b"].n_params() * 2 / GIB, abs=0.01)
    assert "combine a smaller block" in err or "what to change" in err
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "home").exists()    # nothing written


def test_engine_and_planner_charge_the_capped_score_blocks(tmp_path, monkeypatch):
    """An H2O prompt pass on a CPU materialises logits in blocks capped at ops.SCORE_BLOCK_BYTES; the engine's
    workspace reservation and the planner's estimate both follow the cap, not a query_chunk-sized block (which
    over-charges a long prompt's run and shrinks the batch the planner picks)."""
    from flexgen_h2o.models import ops
    model = tiny_hf("llama")
    cfg = from_hf_config(model.config.to_dict())
    prompt_len, h = 20, cfg.n_heads
    monkeypatch.setattr(ops, "MIN_QUERY_CHUNK", 4)
    monkeypatch.setattr(ops, "SCORE_BLOCK_BYTES", h * prompt_len * 4 * 4)      # one sequence, 4 queries
    eviction = EvictionConfig(policy="h2o", hh_ratio=0.2)
    offload = OffloadPolicy.from_percent((100, 0, 100, 0, 100, 0), gpu_batch_size=3, num_gpu_batches=1)
    engine = make_engine(model, offload=offload, eviction=eviction, offload_dir=tmp_path, record=False)
    charged = []
    tier = engine.tiers["compute"]
    real_reserve = tier.reserve
    monkeypatch.setattr(tier, "reserve", lambda n, name="": charged.append((name, n)) or real_reserve(n, name))
    try:
        engine.generate(random_prompts([prompt_len] * 3), greedy(2))
    finally:
        engine.close()
    workspace = [n for name, n in charged if name.startswith("workspace")]
    capped = cfg.workspace_bytes(3, prompt_len, 4, h * 4 * prompt_len * 4)
    whole = cfg.workspace_bytes(3, prompt_len, 4, 3 * h * prompt_len * prompt_len * 4)   # 3 sequences x 20 queries
    assert workspace == [capped] and capped < whole
    est = estimate(cfg, offload, eviction, prompt_len=prompt_len, gen_len=2, compute_dtype_bytes=4)
    monkeypatch.setattr(ops, "SCORE_BLOCK_BYTES", 1 << 40)
    uncapped = estimate(cfg, offload, eviction, prompt_len=prompt_len, gen_len=2, compute_dtype_bytes=4)
    saved = uncapped.bytes["compute"]["workspace"] - est.bytes["compute"]["workspace"]
    assert saved == whole - capped


def test_a_suggested_placement_keeps_every_other_setting_of_the_run():
    """A suggestion is priced for the configuration the user runs: only the placement (or batch) changes."""
    from flexgen_h2o.planner.preflight import _candidates
    off = OffloadPolicy(gpu_batch_size=8, prefill_batch_size=3, kv_dtype="float32", overlap=False,
                        uncached_disk_weights=True)
    moves = [new for text, new, _ in _candidates(off, EvictionConfig()) if text.startswith("--percent")]
    assert len(moves) == 4                # the two moves that equal the default placement are skipped
    for new in moves:
        assert new.replace(**dict(zip(("weights_gpu_pct", "weights_cpu_pct", "cache_gpu_pct", "cache_cpu_pct",
                                       "act_gpu_pct", "act_cpu_pct"), off.percent))) == off
