"""The cost model (planner/cost.py), the placement search (planner/search.py) and the rates they use
(calibrate.py), on hand-made rates so every expected value can be worked out by hand."""
from __future__ import annotations

import json
import math

import pytest

from flexgen_h2o import auto_offload
from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import PRESETS
from flexgen_h2o.planner.cost import PROBE_ROWS, PROBE_WINDOW, _rate, linear_points, predict, probe_key
from flexgen_h2o.planner.plan import Plan
from flexgen_h2o.planner.preflight import Machine
from flexgen_h2o.planner.search import search

GIB = 1 << 30
FLAT = {str(r): 10.0 for r in (1, 4, 16, 64, 256, 1024)}          # 10 GFLOP/s at every row count
RATES = {
    "linear_GFLOPs": {"fp16": FLAT, "int8-g64": FLAT, "int4-g64": FLAT},
    "decode_ns_per_slot_fp16": 10.0, "decode_ns_per_slot_int8-g64": 10.0, "decode_ns_per_slot_int4-g64": 10.0,
    "prompt_scored_GFLOPs": 10.0, "prompt_plain_GFLOPs": 10.0,
    "mem_read_GBps": 10.0, "memcpy_GBps": 10.0,
    "disk_read_GBps": 0.1, "disk_write_GBps": 0.1, "page_cache_read_GBps": 1.0,
    "fixed_decode_s_per_layer": 0.0, "fixed_prefill_s_per_layer": 0.0, "gpu": None, "date": "test",
}
TINY = PRESETS["smollm2-135m"].replace(name="cost-tiny", n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2,
                                       head_dim=16, ffn_size=128, vocab_size=256, tie_word_embeddings=False)


def _plan(offload: OffloadPolicy, eviction: EvictionConfig | None = None, prompt: int = 16, gen: int = 5) -> Plan:
    return Plan.for_shape(TINY, offload, eviction or EvictionConfig(policy="full"), prompt_len=prompt, gen_len=gen,
                          device_type="cpu", compute_itemsize=4)


def test_rate_interpolates_in_log_rows():
    pts = [(1, 10.0), (4, 30.0), (16, 50.0)]
    assert _rate(pts, 1) == 10.0 and _rate(pts, 0.5) == 10.0 and _rate(pts, 100) == 50.0
    assert _rate(pts, 2) == pytest.approx(20.0) and _rate(pts, 8) == pytest.approx(40.0)


def test_the_models_own_matrices_set_the_decode_rate_and_the_generic_one_the_prompts():
    """A model's probe (its own matrices at decode rows) replaces the generic rate up to its largest row count;
    above it (prompt chunks) the generic matrix's rate stays. Halving the probe's rate doubles a decode step's
    linear time (no attention cost here: zero slots cost) and leaves the prompt pass alone."""
    key = probe_key(TINY, "fp16")
    slow = {**RATES, "decode_ns_per_slot_fp16": 0.0,
            "model_linear_GFLOPs": {key: {str(r): 5.0 for r in PROBE_ROWS}, "fp16:1x1": {"1": 1e9}}}
    pts = linear_points(slow, "fp16", TINY)
    assert dict(pts) == {1: 5.0, 4: 5.0, 16: 5.0, 64: 5.0, 128: 5.0, 256: 10.0, 1024: 10.0}
    assert linear_points(slow, "int4-g64", TINY) == sorted((int(k), v) for k, v in FLAT.items())
    plan = _plan(OffloadPolicy(gpu_batch_size=2), prompt=200)
    fast, half = predict(plan, {**RATES, "decode_ns_per_slot_fp16": 0.0}), predict(plan, slow)
    assert half.decode_s == pytest.approx(2 * fast.decode_s, rel=1e-9)
    # 400 prompt rows: the generic rate; only the head's 2 rows (a sliver of the FLOPs) at the probe's
    assert fast.prefill_s < half.prefill_s < 1.02 * fast.prefill_s


def test_a_probed_block_prices_the_decode_step_and_attention_past_its_window():
    """With the model's own block timed (model_probe.py), a decode step is that time per block at the batch's
    rows (interpolated in log rows, in proportion beyond the largest) plus the head's FLOPs at the linear rate;
    the attention slots inside the probe's window are in the block's time, those beyond it are added."""
    blocks = {str(r): 1e-3 * r for r in (1, 4, 16)}
    rates = {**RATES, "model_block": {probe_key(TINY, "fp16"): {"decode_s": blocks}}}
    head = 2 * 256 * 64 / 10e9                                     # per row: the untied head at 10 GFLOP/s
    for rows, block_s in ((4, 4e-3), (8, 8e-3), (32, 32e-3)):
        p = predict(_plan(OffloadPolicy(gpu_batch_size=rows)), rates)            # window 16 + 2.5 < PROBE_WINDOW
        assert p.decode_s == pytest.approx(4 * (2 * block_s + rows * head), rel=1e-9), rows
    long = predict(_plan(OffloadPolicy(gpu_batch_size=4), prompt=100, gen=5), rates)
    beyond = 4 * 2 * (100 + 2.5 - PROBE_WINDOW) * 2 * 10e-9       # rows x KV heads x slots past it x layers
    assert long.decode_s == pytest.approx(4 * (2 * 4e-3 + 4 * head + beyond), rel=1e-9)


def test_a_models_matrices_are_timed_once_per_format_and_cached(tmp_path, monkeypatch):
    from flexgen_h2o import calibrate
    monkeypatch.setenv("FLEXGEN_H2O_HOME", str(tmp_path / "home"))
    path = calibrate.cache_path(tmp_path / "off")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(RATES))
    got = calibrate.rates(tmp_path / "off", smoke=True, say=lambda s: None, model=TINY, formats=("int4-g64",))
    table, blocks = got["model_linear_GFLOPs"], got["model_block"]
    assert sorted(table) == sorted(blocks) == [probe_key(TINY, "int4-g64")]
    assert all(set(v) == {str(r) for r in PROBE_ROWS} and min(v.values()) > 0 for v in table.values())
    for v in blocks.values():                                   # smoke: 3 row counts
        assert set(v["decode_s"]) == {"1", "4", "16"} and min(v["decode_s"].values()) > 0
    assert json.loads(path.read_text())["model_block"] == blocks
    import flexgen_h2o.model_probe as probe
    monkeypatch.setattr(probe, "measure_matrices", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr(probe, "measure_block", lambda *a, **k: pytest.fail("measured again"))
    assert calibrate.rates(tmp_path / "off", model=TINY, formats=("int4-g64",), say=lambda s: None) == got


def test_all_in_ram_decode_is_linear_flops_plus_attention_by_hand():
    """Everything in RAM, full cache, one GPU batch of 2: a decode step is the matmul FLOPs at 10 GFLOP/s plus
    10 ns per (sequence, KV head, slot) of the window, which grows from the prompt (16) by half the run (5 / 2)."""
    plan = _plan(OffloadPolicy(gpu_batch_size=2))
    p = predict(plan, RATES)
    h, f, v, layers = 64, 128, 256, 2
    per_row = layers * 2 * (h * 64 + 2 * h * 32 + 64 * h + 3 * h * f) + 2 * v * h
    step = 2 * per_row / 10e9 + 2 * 2 * (16 + 2.5) * layers * 10e-9
    assert p.decode_s == pytest.approx(4 * step, rel=1e-9)
    assert p.limits["decode"] == "compute" and p.block_tokens == 10 and p.blocks == 1
    assert p.total_tok_s == pytest.approx(10 / (p.prefill_s + p.decode_s))


def test_disk_weights_cost_their_bytes_at_the_page_cache_or_the_disk_rate():
    ram = predict(_plan(OffloadPolicy(gpu_batch_size=2)), RATES)
    off = OffloadPolicy.from_percent([0, 0, 100, 0, 100, 0], gpu_batch_size=2)
    cached = predict(_plan(off), RATES, free_ram=GIB)
    cold = predict(_plan(off), RATES, free_ram=0)              # they do not fit the page cache: the disk's rate
    assert ram.decode_s < cached.decode_s < cold.decode_s
    # a page-cache read is a copy the compute cores make, at the page-cache rate (1 GB/s here), added to compute
    from flexgen_h2o.planner.cost import layer_costs
    disk = sum(g.disk_bytes for g in layer_costs(TINY, off.tier_fractions("weights"), off.weight_format, off.sep_layer))
    assert cached.decode_s == pytest.approx(ram.decode_s + 4 * disk / 1e9, rel=1e-9)
    assert cold.limits["decode"] == "weights"
    no_overlap = predict(_plan(off.replace(overlap=False)), RATES, free_ram=0)
    assert no_overlap.decode_s > cold.decode_s             # the lanes add up instead of overlapping


def test_disk_kv_is_served_by_the_page_cache_in_the_share_that_fits_beside_the_run():
    """KV on disk: every byte a step reads is priced at the page cache's rate for the share of the disk-homed
    bytes that fits the RAM left free, at the disk's for the rest (linear in that share: without overlap half the
    room is the mean of all and none), and the prompt's KV is written at the disk's write rate beyond it."""
    off = OffloadPolicy.from_percent([100, 0, 0, 0, 100, 0], gpu_batch_size=2, overlap=False)
    demand = _plan(off).kv_bytes()["disk"]
    roomy, half, none = (predict(_plan(off), RATES, free_ram=f) for f in (GIB, demand // 2, 0))
    assert roomy.decode_s < half.decode_s < none.decode_s and roomy.prefill_s < none.prefill_s
    assert half.decode_s == pytest.approx((roomy.decode_s + none.decode_s) / 2, rel=1e-6)
    assert predict(_plan(off), RATES).decode_s == roomy.decode_s             # no limit known: all of it fits


def test_weights_and_kv_on_disk_share_one_lane():
    """Both on disk and nothing cached: the step waits for the weights' bytes and then the KV's: what the KV adds
    over all-in-RAM comes on top of the weights-on-disk step (the longer of the two lanes would add nothing: the
    weights' lane is the longer in every layer here)."""
    both, weights, kv, ram = (predict(_plan(OffloadPolicy.from_percent(p, gpu_batch_size=2)), RATES, free_ram=0)
                              for p in ([0, 0, 0, 0, 100, 0], [0, 0, 100, 0, 100, 0], [100, 0, 0, 0, 100, 0],
                                        [100, 0, 100, 0, 100, 0]))
    assert weights.limits["decode"] == "weights" and kv.limits["decode"] == "kv"
    assert both.decode_s - weights.decode_s > kv.decode_s - ram.decode_s > 0


def test_int4_weights_on_disk_read_about_a_quarter_of_the_bytes():
    off = OffloadPolicy.from_percent([0, 0, 100, 0, 100, 0], gpu_batch_size=2)
    fp16 = predict(_plan(off), RATES, free_ram=0)
    int4 = predict(_plan(off.replace(weight_bits=4)), RATES, free_ram=0)
    assert 0.2 < int4.decode_s / fp16.decode_s < 0.45          # 4.5 bits of 16 plus the fp16 vectors


def test_an_h2o_budget_reads_a_fixed_window():
    full = predict(_plan(OffloadPolicy(gpu_batch_size=2), prompt=200, gen=50), RATES)
    h2o = predict(_plan(OffloadPolicy(gpu_batch_size=2), EvictionConfig(policy="h2o", hh_size=8, recent_size=8),
                        prompt=200, gen=50), RATES)
    assert h2o.decode_s < full.decode_s
    assert predict(_plan(OffloadPolicy(gpu_batch_size=2)), RATES, n_prompts=5).blocks == 3


def test_search_returns_fitting_plans_best_first_and_keeps_the_users_budget():
    machine = Machine(ram_available=4 * GIB, ram_total=8 * GIB, process_rss=0)
    ev = EvictionConfig(policy="h2o", hh_ratio=0.1)
    found = search(TINY, ev, OffloadPolicy(), RATES, prompt_len=64, gen_len=8, n_prompts=16, device_type="cpu",
                   machine=machine, compress=False)
    assert found and all(all(c.ok for c in cand.checks) for cand in found)
    speeds = [c.prediction.total_tok_s for c in found]
    assert speeds == sorted(speeds, reverse=True)
    best = found[0].offload
    assert best.block_size <= 16 and best.weight_bits is None and best.kv_bits is None


def test_search_moves_weights_to_disk_when_ram_is_short_and_refuses_when_nothing_fits():
    big = PRESETS["opt-1.3b"]
    small = Machine(ram_available=1 * GIB, ram_total=2 * GIB, process_rss=0)
    found = search(big, EvictionConfig(policy="full"), OffloadPolicy(), RATES, prompt_len=32, gen_len=4, n_prompts=4,
                   device_type="cpu", machine=small, compress=False)
    assert found and found[0].offload.tier_fractions("weights")[2] > 0     # 2.6 GB of fp16 weights: some on disk
    # every plan leaves 4 % of the RAM free: with 1300 MiB the preflight alone takes a plan at 99.7 % of it
    edge = search(big, EvictionConfig(policy="full"), OffloadPolicy(), RATES, prompt_len=32, gen_len=4, n_prompts=4,
                  device_type="cpu", machine=Machine(1300 << 20, 2 * GIB), compress=False, keep=1000)
    assert edge and all(c.need <= 0.96 * c.available for cand in edge for c in cand.checks if c.resource == "RAM")
    tiny = Machine(ram_available=1 << 20, ram_total=1 << 21, process_rss=0)
    assert search(big, EvictionConfig(policy="full"), OffloadPolicy(), RATES, prompt_len=32, gen_len=4, n_prompts=4,
                  device_type="cpu", machine=tiny, compress=False) == []


def test_rates_are_measured_once_and_cached(tmp_path, monkeypatch):
    from flexgen_h2o import calibrate
    monkeypatch.setenv("FLEXGEN_H2O_HOME", str(tmp_path / "home"))
    first = calibrate.rates(tmp_path / "off", smoke=True, say=lambda s: None)
    for fmt in ("fp16", "int8-g64", "int4-g64"):
        assert all(v > 0 and math.isfinite(v) for v in first["linear_GFLOPs"][fmt].values())
        assert first[f"decode_ns_per_slot_{fmt}"] > 0
    for key in ("mem_read_GBps", "disk_read_GBps", "page_cache_read_GBps", "fixed_decode_s_per_layer"):
        assert first[key] > 0
    path = calibrate.cache_path(tmp_path / "off")
    assert json.loads(path.read_text()) == first
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert calibrate.rates(tmp_path / "off", say=lambda s: None) == first
    assert not list((tmp_path / "off").glob("calibrate-*"))             # the disk probe's file is gone


def test_processes_that_need_the_rates_at_once_measure_them_once(tmp_path, monkeypatch):
    """torchrun's ranks on one node ask at the same moment: the first measures, the others wait on the cache
    folder's lock and read what it wrote (measuring side by side, each would time the others' load)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from flexgen_h2o import calibrate
    monkeypatch.setenv("FLEXGEN_H2O_HOME", str(tmp_path / "home"))
    calls = []

    def slow_measure(root, smoke=False):
        calls.append(root)
        time.sleep(0.5)
        return {**RATES, "measure_s": 0.5}
    monkeypatch.setattr(calibrate, "measure", slow_measure)
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda _: calibrate.rates(tmp_path / "off", say=lambda s: None), range(3)))
    assert len(calls) == 1 and got[0]["measure_s"] == 0.5 and all(g == got[0] for g in got)


def _cached_rates(tmp_path, monkeypatch) -> dict:
    """RATES with TINY probed in every format, cached for the offload folder tmp_path/off; measuring fails."""
    from flexgen_h2o import calibrate
    monkeypatch.setenv("FLEXGEN_H2O_HOME", str(tmp_path / "home"))
    path = calibrate.cache_path(tmp_path / "off")
    path.parent.mkdir(parents=True)
    own = {probe_key(TINY, fmt): {str(r): 10.0 for r in PROBE_ROWS} for fmt in calibrate.WEIGHT_FORMATS}
    block = {key: {"decode_s": {str(r): 1e-4 * r for r in PROBE_ROWS}} for key in own}
    path.write_text(json.dumps({**RATES, "model_linear_GFLOPs": own, "model_block": block}))
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("measured"))
    import flexgen_h2o.model_probe as probe
    monkeypatch.setattr(probe, "measure_matrices", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(probe, "measure_block", lambda *a, **k: pytest.fail("measured"))
    return json.loads(path.read_text())


def test_a_given_benchmark_plan_is_predicted_at_its_full_length_beside_the_runs_peak(tmp_path, monkeypatch):
    """A benchmark with --cut-gen-len is planned for the cut and measured as projected to --gen-len: a given
    placement is predicted at the full length, the page cache holding what the RAM check leaves beside the run."""
    import argparse

    from flexgen_h2o.frontends.auto import predict_if_calibrated
    from flexgen_h2o.planner import estimate
    from flexgen_h2o.planner.preflight import Check
    rates = _cached_rates(tmp_path, monkeypatch)
    off = OffloadPolicy.from_percent([100, 0, 0, 0, 100, 0], gpu_batch_size=2)
    cut = estimate(TINY, off, EvictionConfig(policy="full"), prompt_len=16, gen_len=4, n_seqs=2)
    checked = [Check("RAM", 100 << 20, (100 << 20) + 1000, {})]        # 1000 bytes left for the page cache
    args = argparse.Namespace(calibrate=False, offload_dir=str(tmp_path / "off"), no_progress=True)
    got = predict_if_calibrated(args, cut, checked, 2, gen_len=64)
    want = predict(_plan(off, gen=64), rates, n_prompts=2, free_ram=1000)
    assert (got.prefill_s, got.decode_s) == pytest.approx((want.prefill_s, want.decode_s), rel=1e-9)
    assert got.decode_s > 10 * predict(cut.plan, rates, free_ram=1000).decode_s      # 63 steps, not 3
    assert predict_if_calibrated(args, cut, checked, 2).decode_s == predict(cut.plan, rates, free_ram=1000).decode_s


def test_the_api_chooses_from_cached_rates(tmp_path, monkeypatch):
    """flexgen_h2o.auto_offload: the search's best plan for this machine, from the cached rates (nothing
    measured)."""
    rates = _cached_rates(tmp_path, monkeypatch)
    ev = EvictionConfig(policy="h2o", hh_ratio=0.1)
    got, _ = auto_offload(TINY, prompt_len=64, gen_len=8, n_prompts=4, eviction=ev, device="cpu",
                          offload_dir=str(tmp_path / "off"))
    machine = Machine.probe()
    want = search(TINY, ev, OffloadPolicy(), rates, prompt_len=64, gen_len=8, n_prompts=4,
                  device_type="cpu", machine=machine, offload_root=tmp_path / "off", keep=1)[0].offload
    assert got == want and got.block_size <= 4


def test_compression_is_chosen_only_for_a_clear_gain():
    """Compression changes the output: at equal rates (no gain) the search keeps fp16; where fp16 weights must
    stream from a slow disk and packed ones fit in RAM, packing wins by far more than the margin."""
    ev = EvictionConfig(policy="h2o", hh_ratio=0.1)
    roomy = Machine(ram_available=4 * GIB, ram_total=8 * GIB, process_rss=0)
    best = search(TINY, ev, OffloadPolicy(), RATES, prompt_len=64, gen_len=8, n_prompts=4, device_type="cpu",
                  machine=roomy)[0]
    assert best.offload.weight_bits is None and best.offload.kv_bits is None
    slow = {**RATES, "page_cache_read_GBps": 0.01, "disk_read_GBps": 0.01}
    found = search(PRESETS["opt-1.3b"], ev, OffloadPolicy(), slow, prompt_len=32, gen_len=4, n_prompts=4,
                   device_type="cpu", machine=Machine(ram_available=int(1.5 * GIB), ram_total=2 * GIB, process_rss=0))
    assert found[0].offload.weight_bits in (4, 8) and found[0].offload.tier_fractions("weights")[2] == 0


def test_page_selection_prices_the_pages_it_reads():
    """KV on a cold disk: a step under page selection reads its share of the window, not all of it, so it is
    priced below the full cache's and above nothing; the dense layers read theirs whole; the planner counts the
    summaries on the compute tier."""
    from flexgen_h2o.kv.page_rule import PageRule
    from flexgen_h2o.planner.cost import page_reads
    from flexgen_h2o.planner.memory import plan_bytes
    off = OffloadPolicy.from_percent([100, 0, 0, 0, 100, 0], gpu_batch_size=2, overlap=False)
    rule = PageRule(page_size=8, fetch_ratio=0.25, score="bound")
    pages, dense = (EvictionConfig(pages=r) for r in (rule, PageRule(page_size=8, fetch_ratio=0.25, dense_layers=1,
                                                                     score="bound")))
    full, paged, half_dense, ram = (predict(_plan(o, ev, prompt=256, gen=8), RATES, free_ram=0) for o, ev in (
        (off, None), (off, pages), (off, dense), (OffloadPolicy(gpu_batch_size=2), None)))
    assert ram.decode_s < paged.decode_s < half_dense.decode_s < full.decode_s
    assert page_reads(_plan(off, pages, prompt=256, gen=8), 260.0, 2) == (72.0, 260.0 / 8)   # 9 pages of 8
    summaries = plan_bytes(_plan(off, pages, prompt=256, gen=8)).bytes["compute"]["kv"]
    assert summaries == 2 * TINY.n_layers * 2 * TINY.n_kv_heads * (264 // 8) * TINY.head_dim * 4
    keys = EvictionConfig(pages=PageRule(page_size=8, fetch_ratio=0.25))      # int4 rows: 8 bytes + fp16 min, step
    assert page_reads(_plan(off, keys, prompt=256, gen=8), 260.0, 2) == (72.0, 260.0)
    assert plan_bytes(_plan(off, keys, prompt=256, gen=8)).bytes["compute"]["kv"] == TINY.n_layers * 2 * \
        TINY.n_kv_heads * (264 + 1) * (8 + 4)
    by_keys = predict(_plan(off, keys, prompt=256, gen=8), RATES, free_ram=0)
    assert paged.decode_s < by_keys.decode_s < full.decode_s


def test_auto_prices_a_paged_cache_on_disk_by_the_pages_it_reads(tmp_path):
    """`--percent auto` with page selection: a KV homed on disk is among the fitting plans, priced by the share a
    step reads, so its predicted decode is under half the full cache's at the same plan."""
    from flexgen_h2o.kv.page_rule import PageRule
    machine = Machine(ram_available=4 * GIB, ram_total=8 * GIB, process_rss=0)
    paged = EvictionConfig(pages=PageRule(page_size=8, fetch_ratio=0.2))
    found = search(TINY, paged, OffloadPolicy(), RATES, prompt_len=512, gen_len=8, n_prompts=16, device_type="cpu",
                   machine=machine, compress=False, offload_root=tmp_path, keep=1000)
    assert found
    on_disk = [c for c in found if c.offload.tier_fractions("cache")[2] == 1]
    assert on_disk
    same = on_disk[0].offload
    full = predict(Plan.for_shape(TINY, same, EvictionConfig(), prompt_len=512, gen_len=8, n_seqs=same.block_size,
                                  device_type="cpu", compute_itemsize=4), RATES, free_ram=0)
    mine = predict(Plan.for_shape(TINY, same, paged, prompt_len=512, gen_len=8, n_seqs=same.block_size,
                                  device_type="cpu", compute_itemsize=4), RATES, free_ram=0)
    assert mine.decode_s < 0.5 * full.decode_s
