"""The suite's pure parts: workloads, system selection, probe projection, the roofline arithmetic, the result
schema, and the report (the batch search: test_suite_search.py). No model runs here."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import machine as mach
from benchmarks.search import project_probe
from benchmarks.suite import overridden, parse_batches, run_workload, summarize, validate_row
from benchmarks.suite_report import CAPPED_BEST, drift_table, write_report
from benchmarks.systems import RESULT_KEYS, Candidate, all_systems, rates, select_systems
from benchmarks.workloads import GIB, WORKLOADS, select_workloads, smoke

MACHINE = {"date": "2026-11-21", "cpu": "test cpu", "threads": 2, "torch": "x",
           "gemm_decode_GFLOPs": {"1": 10.0, "8": 20.0, "64": 60.0}, "gemm_prefill_GFLOPs": 100.0,
           "gemm_prefill_rows": 2048, "memcpy_GBps": 20.0, "mem_read_GBps": 10.0, "disk_write_GBps": 1.0,
           "disk_read_GBps": 2.0, "disk_read_cold_fraction": 1.0, "gpu": None}


def test_workloads_cover_the_issue_shapes():
    shapes = {(w.model, w.prompt_len, w.gen_len) for w in WORKLOADS.values()}
    for g in (32, 128, 512, 1024):
        assert ("smollm2-135m", 512, g) in shapes
    assert ("smollm2-135m", 2048, 512) in shapes
    disk = [w for w in WORKLOADS.values() if w.cold_disk]
    assert disk and all(w.model == "opt-1.3b" and w.dummy and w.percent[:2] == (0, 0) for w in disk)
    opt13_fp16 = disk[0].model_config().n_params() * 2
    # weights beyond the RAM budget, except where Accelerate runs: it peaks at ~2.4 GiB at batch 1, so below
    # the weights' size it has no batch at all (documented in workloads.py and docs/suite.md)
    assert all(w.budget_bytes < opt13_fp16 for w in disk if "accelerate" not in w.systems)
    assert WORKLOADS["disk512+128"].budget_bytes == 3 * GIB
    # every throughput workload lists the GPU-only peers (skipped here with the reason); chat lists its own
    assert all(w.budget_bytes > 0 and {"deepspeed", "flexgen"} <= set(w.systems) for w in WORKLOADS.values()
               if not w.is_chat)
    assert "accelerate" in WORKLOADS["disk512+128"].systems


def test_smoke_shrinks_and_selection_rejects_unknown():
    s = smoke(WORKLOADS["disk512+128"])
    assert (s.model, s.prompt_len, s.gen_len, s.max_batch, s.is_smoke) == ("opt-125m", 64, 8, 2, True)
    assert not any(n.endswith(("-10", "-40")) for n in s.systems) and "ours-full" in s.systems
    assert "ours-h2o-20" not in s.systems                                   # one case per adapter and workload
    quick = smoke(WORKLOADS["s512+128"]).systems
    assert {"ours-h2o-20", "hf", "kvpress-observed-20", "kvpress-decoding-20"} <= set(quick)
    assert not any(n.startswith(("openvino", "vllm")) or n in ("ours-full", "kvpress-streaming-20") for n in quick)
    assert {"openvino-evict-20", "vllm"} <= set(WORKLOADS["s512+512"].systems)
    assert [w.name for w in select_workloads(["s512+32"], True)] == ["s512+32-smoke"]
    with pytest.raises(SystemExit, match="unknown workload"):
        select_workloads(["nope"], False)


def test_select_systems_prefix_glob_default():
    known = list(all_systems())
    assert select_systems(["ours-h2o"], (), known) == ["ours-h2o-10", "ours-h2o-20", "ours-h2o-40"]
    assert select_systems(["kvpress-*-20", "hf"], (), known) == ["hf", "kvpress-observed-20",
                                                                  "kvpress-streaming-20", "kvpress-decoding-20"]
    assert select_systems(["vllm"], (), known) == ["vllm", "vllm-inproc"]
    assert select_systems(None, ("flexgen", "ours-full"), known) == ["ours-full", "flexgen"]
    with pytest.raises(SystemExit, match="no system matches"):
        select_systems(["nope"], (), known)


def test_project_probe_and_flexgen_rates():
    row = {"batch": 4, "gen_len": 5, "prefill_s": 2.0, "decode_s": 1.0, "step_times_s": [0.4, 0.2, 0.2, 0.2],
           "peak_rss_bytes": 100}
    total, peak = project_probe(row, 11, growth_bytes=50, peak_bytes=row["peak_rss_bytes"])
    assert total == pytest.approx(4 * 11 / (2.0 + 0.2 * 10)) and peak == 150
    r = rates(4, 512, 32, 2.0, 31.0)
    assert r == {"prefill_tok_s": 1024.0, "decode_tok_s": 4.0, "total_tok_s": pytest.approx(128 / 33)}


def test_roofline_arithmetic():
    cfg = WORKLOADS["s512+32"].model_config()
    f_pre, f_step = mach.model_flops(cfg, 2, 512, 100)
    h, d, L = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_layers
    per_tok = L * (h * (2 * d + 2 * cfg.n_kv_heads * cfg.head_dim) + 3 * h * cfg.ffn_size)
    assert f_step == 2 * (2 * per_tok + 2 * cfg.vocab_size * h + 4 * 100 * d * L)
    assert f_pre == 2 * (2 * 512 * per_tok + 2 * 512 ** 2 * d * L + 2 * cfg.vocab_size * h)
    assert mach.peak_flops(MACHINE) == 100e9
    # io-bound decode: 1 GB offloaded at 2 GB/s + KV 2 x 10 MB + 0 resident at 10 GB/s
    b = mach.bound(MACHINE, cfg, batch=2, prompt_len=512, gen_len=33, kv_read_bytes_per_seq=1e7,
                   offloaded_weight_bytes=1e9, resident_weight_bytes=0.0, kv_tokens=100)
    assert b["decode_limit"] == "io" and b["decode_step_s"] == pytest.approx(0.5 + 2e7 / 1e10)
    assert b["prefill_s"] == pytest.approx(max(f_pre / 100e9, 0.5))
    assert b["total_tok_s"] == pytest.approx(2 * 33 / (b["prefill_s"] + 32 * b["decode_step_s"]))
    # weights that fit the free RAM come back from the page cache after the first pass
    pc = mach.bound({**MACHINE, "page_cache_read_GBps": 5.0, "mem_available_bytes": 4e9}, cfg, batch=2,
                    prompt_len=512, gen_len=33, kv_read_bytes_per_seq=1e7, offloaded_weight_bytes=1e9,
                    resident_weight_bytes=0.0, kv_tokens=100)
    assert pc["decode_step_s"] == pytest.approx(0.2 + 2e7 / 1e10) and pc["decode_weights_from"] == "page cache"
    assert pc["prefill_s"] == b["prefill_s"] and b["decode_weights_from"] == "disk"
    # a GPU machine: its fp16 GEMM peak, no DRAM weight stream; compute-bound when nothing moves
    gpu = {"h2d_GBps": 20, "d2h_GBps": 20, "device_read_GBps": 1000, "gemm_fp16_TFLOPs": 0.2}
    c = mach.bound({**MACHINE, "gpu": gpu}, cfg, batch=2, prompt_len=512, gen_len=33,
                   kv_read_bytes_per_seq=0, offloaded_weight_bytes=0, resident_weight_bytes=5e8, kv_tokens=100)
    assert mach.peak_flops({**MACHINE, "gpu": gpu}) == 0.2e12
    assert c["decode_limit"] == "compute" and c["decode_step_s"] == pytest.approx(f_step / 0.2e12)
    # weights homed in host RAM cross the link at every pass; the KV is read from device memory
    h = mach.bound({**MACHINE, "gpu": gpu}, cfg, batch=2, prompt_len=512, gen_len=33, kv_read_bytes_per_seq=1e9,
                   offloaded_weight_bytes=0, resident_weight_bytes=0, kv_tokens=100, host_weight_bytes=4e9)
    assert h["decode_limit"] == "io" and h["decode_step_s"] == pytest.approx(4e9 / 20e9)     # KV read beside it
    big_kv = mach.bound({**MACHINE, "gpu": gpu}, cfg, batch=2, prompt_len=512, gen_len=33, kv_read_bytes_per_seq=2e11,
                        offloaded_weight_bytes=0, resident_weight_bytes=0, kv_tokens=100, host_weight_bytes=4e9)
    assert big_kv["decode_limit"] == "device memory" and big_kv["decode_step_s"] == pytest.approx(4e11 / 1000e9)
    assert h["prefill_s"] == pytest.approx(max(f_pre / 0.2e12, 4e9 / 20e9))


def _ours_raw(block=2):
    return {"block_size": block, "prefill_s": 1.0, "decode_s": 2.0, "peak_rss_bytes": 900 << 20,
            "kv_cache_bytes": 1000 * block, "kv_slots_per_seq": 50, "step_times_s": [0.3, 0.25, 0.25],
            "weights_by_tier": {"compute": 1, "host": 0, "disk": 0}}


def test_normalized_rows_have_the_schema_and_summarize():
    s, w = all_systems()["ours-h2o-20"], smoke(WORKLOADS["s512+128"])
    rows = [s.normalize(_ours_raw(), w, Candidate(2, 2), 8, wall_s=5.0 + i, threads=2, probe=False, repeat=i)
            for i in range(3)]
    assert set(RESULT_KEYS) <= set(rows[0]) and validate_row(rows[0]) == []
    assert rows[0]["kv_bytes_per_seq"] == 1000 and rows[0]["total_tok_s"] == pytest.approx(2 * 8 / 3.0)
    summ = summarize(rows)
    assert summ["wall_s"] == 6.0 and summ["step_times_s"] == [0.3, 0.25, 0.25] and summ["repeats"] == 3
    bad = dict(rows[0], decode_tok_s=float("nan"))
    del bad["wall_s"]
    assert "missing wall_s" in validate_row(bad) and any("decode_tok_s" in p for p in validate_row(bad))
    json.dumps(rows)


def test_gpu_only_peers_skip_with_the_reason(monkeypatch, tmp_path):
    import benchmarks.systems.gpu_check as gc
    monkeypatch.setattr(gc, "cuda_available", lambda: False)
    systems = all_systems()
    w = smoke(WORKLOADS["s512+128"])
    a = SimpleNamespace(work=tmp_path, repeats=1, max_probes=1, out=tmp_path, threads=2, timeout=None)
    res = run_workload(w, ["deepspeed", "flexgen"], systems, SimpleNamespace(a=a, env={}), MACHINE)
    assert [(e["system"], e["status"], e["reason"]) for e in res["systems"]] == [
        ("deepspeed", "skipped", "needs a CUDA GPU"), ("flexgen", "skipped", "needs a CUDA GPU")]
    assert systems["kvpress-observed-20"].skip_reason(smoke(WORKLOADS["disk512+128"]))
    assert systems["accelerate"].skip_reason(w) and systems["hf"].skip_reason(WORKLOADS["disk512+128"])


def test_gpu_workload_is_skipped_without_a_gpu_and_budgets_gpu_memory(monkeypatch, tmp_path):
    import benchmarks.suite as suite
    monkeypatch.setattr(suite, "cuda_available", lambda: False)
    w = WORKLOADS["gpu-opt30b-512+512"]
    assert w.needs_gpu and w.percent == (0, 100, 100, 0, 100, 0) and w.model == "opt-30b"
    a = SimpleNamespace(work=tmp_path, repeats=1, max_probes=1, out=tmp_path, threads=2, timeout=None)
    res = run_workload(w, ["ours-full", "ours-h2o-20", "flexgen"], all_systems(), SimpleNamespace(a=a, env={}),
                       MACHINE)
    assert {(e["status"], e["reason"]) for e in res["systems"]} == {("skipped", "needs a CUDA GPU")}
    row = {"peak_rss_bytes": 80 * GIB, "peak_gpu_bytes": 30 * GIB}
    assert w.peak_bytes(row) == 30 * GIB and WORKLOADS["s2048+512"].peak_bytes(row) == 80 * GIB
    # ours' candidates are sized by the planner's compute tier (the device) in fp16
    h2o, full = (all_systems()[n].candidates(w, 512) for n in ("ours-h2o-20", "ours-full"))
    fits = lambda cands: max(c.batch for c in cands if c.predicted_bytes <= w.budget_bytes)  # noqa: E731
    assert fits(h2o) > 3 * fits(full)


def test_report_lists_skipped_rows_and_plots(tmp_path):
    from benchmarks.suite import roofline
    s, w = all_systems()["ours-full"], smoke(WORKLOADS["s512+128"])
    rows = [s.normalize(_ours_raw(), w, Candidate(2, 2, predicted_bytes=GIB), 8, wall_s=5.0, threads=2,
                        probe=False, repeat=0)]
    summ = summarize(rows)
    ran = {"system": "ours-full", "status": "ran", "reason": None, "runs": rows, "summary": summ,
           "roofline": roofline(MACHINE, w, s, summ),
           "search": [{"candidate": {"batch": 2, "gbs": 2, "num_batches": 1, "predicted_bytes": GIB, "label": "2"},
                       "status": "best", "projected_peak_bytes": 900 << 20, "projected_total_tok_s": 5.0}]}
    skipped = {"system": "flexgen", "status": "skipped", "reason": "needs a CUDA GPU", "search": [], "runs": []}
    doc = {"command": "python -m benchmarks.suite --smoke", "date": "2026-11-21", "smoke": True, "repeats": 1,
           "threads": 2, "suite_s": 60.0, "machine": MACHINE,
           "results": [{"workload": {**w.__dict__}, "systems": [ran, skipped]}]}
    md = write_report(doc, tmp_path)
    assert "SMOKE RUN" in md and "| flexgen | - |" in md and "skipped: needs a CUDA GPU" in md
    assert "batch search capped" not in md
    ran["search"][0]["status"] = CAPPED_BEST
    assert "batch search capped: a larger batch was not tried" in write_report(doc, tmp_path)
    assert "file-backed pages" not in md
    rows[0]["extra"]["rss_file_growth_bytes"] = 3 * GIB // 2
    assert "file-backed pages (mapped files) added up to 1.50 GiB to its RSS" in write_report(doc, tmp_path)
    assert (tmp_path / "throughput_s512+128-smoke.png").stat().st_size > 0
    assert (tmp_path / "steps_s512+128-smoke.png").is_file()
    assert math.isfinite(ran["roofline"]["decode_pct"])


@pytest.mark.slow
def test_quick_mode_runs_every_enabled_system(tmp_path):
    """`python -m benchmarks.suite --quick` end to end, as the issue asks CI to run it: every enabled system on
    this machine runs (or is a row with its reason, e.g. the GPU-only peers here), and every row is well formed.
    It never asserts a speed."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.suite", "--quick", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=1200, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "smoke check passed" in proc.stdout
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    status = {(r["workload"]["name"], e["system"]): e["status"] for r in doc["results"] for e in r["systems"]}
    assert status[("s512+128-smoke", "ours-h2o-20")] == status[("disk512+128-smoke", "ours-full")] == "ran"
    assert status[("s512+128-smoke", "hf")] == status[("disk512+128-smoke", "accelerate")] == "ran"
    assert all(v in ("ran", "skipped") for v in status.values())
    # one case per system: each final run is its probe, which generated the whole smoke length
    runs = [row for r in doc["results"] for e in r["systems"] for row in e["runs"]]
    assert runs and all(row["extra"].get("reused_probe") and row["gen_len"] == 8 for row in runs)


def test_drift_table_compares_the_first_and_last_tenth_of_each_run():
    rising = [0.4] * 10 + [0.5] * 80 + [0.6] * 10
    wl = {"systems": [{"system": "ours-h2o-20", "runs": [{"repeat": 0, "step_times_s": rising},
                                                           {"repeat": 1, "step_times_s": [0.3] * 5}]},
                      {"system": "flexgen", "runs": []}]}
    assert drift_table(wl)[2:] == ["| ours-h2o-20 | 0 | 100 | 400 | 600 | 1.50 |"]    # a 5-step run is too short
    assert drift_table({"systems": [{"system": "hf", "runs": []}]}) == []


def test_real_weights_store_is_converted_once_before_any_system(monkeypatch, tmp_path):
    """On a fresh machine the SmolLM2 store does not exist yet; the suite converts it once per workload before
    the first system prepares (kvpress reads its tokenizer in prepare), never for a dummy workload, and a failed
    conversion is every system's printed reason."""
    import flexgen_h2o.loader as loader
    calls = []
    monkeypatch.setattr(loader, "ensure_store", lambda model, **kw: calls.append(model))
    prepared = []
    systems = all_systems()
    for n in ("ours-full", "ours-h2o-20"):
        monkeypatch.setattr(systems[n], "prepare", lambda w, env, out, n=n: prepared.append((n, list(calls))) or
                            "stop here")
    a = SimpleNamespace(work=tmp_path, repeats=1, max_probes=1, out=tmp_path, threads=2, timeout=None)
    runner = SimpleNamespace(a=a, env={})
    run_workload(smoke(WORKLOADS["s512+128"]), ["ours-full", "ours-h2o-20"], systems, runner, MACHINE)
    assert calls == ["smollm2-135m"] and prepared == [("ours-full", calls), ("ours-h2o-20", calls)]
    run_workload(smoke(WORKLOADS["disk512+128"]), ["ours-full"], systems, runner, MACHINE)
    assert calls == ["smollm2-135m"]                                       # dummy weights: nothing to convert

    def fail(model, **kw):
        raise RuntimeError("no space left on device\nwhile writing layer 3")
    monkeypatch.setattr(loader, "ensure_store", fail)
    res = run_workload(smoke(WORKLOADS["s512+128"]), ["ours-full", "hf"], systems, runner, MACHINE)
    assert {(e["status"], e["reason"]) for e in res["systems"]} == {
        ("skipped", "converting the smollm2-135m store failed: while writing layer 3")}


def test_uncached_disk_workloads_read_the_weights_from_disk_every_step(tmp_path):
    """--uncached-weights: the disk shapes as for a model larger than RAM. Ours gets --uncached-disk-weights,
    Accelerate (mmap'd files) is skipped with its reason, the bound's later passes come from the disk, and a
    RAM workload is refused."""
    from benchmarks.workloads import uncached
    w = uncached(WORKLOADS["disk512+512"])
    assert (w.name, w.uncached, WORKLOADS["disk512+512"].uncached) == ("disk512+512-uncached", True, False)
    assert "read from the disk at every step" in w.describe()
    picked = select_workloads(None, False, uncached_weights=True)
    assert [x.name for x in picked] == [n + "-uncached" for n, x in WORKLOADS.items() if x.cold_disk]
    with pytest.raises(SystemExit, match="needs a disk workload"):
        select_workloads(["s512+128"], False, uncached_weights=True)
    systems = all_systems()
    cmd = systems["ours-h2o-20"].command(w, Candidate(4, 4), 8, tmp_path / "m.json", tmp_path)
    plain = systems["ours-h2o-20"].command(WORKLOADS["disk512+512"], Candidate(4, 4), 8, tmp_path / "m.json", tmp_path)
    assert "--uncached-disk-weights" in cmd and "--uncached-disk-weights" not in plain
    acc = uncached(WORKLOADS["disk512+128"])
    assert "page cache" in systems["accelerate"].skip_reason(acc)
    assert systems["accelerate"].skip_reason(WORKLOADS["disk512+128"]) is None
    cfg = w.model_config()
    m = {**MACHINE, "page_cache_read_GBps": 5.0, "mem_available_bytes": 4e9}
    kw = dict(batch=2, prompt_len=512, gen_len=33, kv_read_bytes_per_seq=1e7, offloaded_weight_bytes=1e9,
              resident_weight_bytes=0.0, kv_tokens=100)
    cold = mach.bound(m, cfg, page_cache=False, **kw)
    assert cold["decode_weights_from"] == "disk" and cold["decode_step_s"] == pytest.approx(0.5 + 2e7 / 1e10)
    assert mach.bound(m, cfg, **kw)["decode_weights_from"] == "page cache"


def test_final_run_reuses_a_probe_only_when_it_ran_the_whole_length(tmp_path):
    from benchmarks.suite import Runner
    a = SimpleNamespace(out=tmp_path, work=tmp_path, threads=2, timeout=None, max_probes=1, batch={})
    runner = Runner(a, {})
    ran = []
    runner.case = lambda s, w, c, gen_len, probe, repeat: ran.append((c.batch, gen_len, probe)) or {
        "batch": c.batch, "gen_len": gen_len, "probe": probe, "extra": {}, "step_times_s": [0.1] * gen_len,
        "prefill_s": 1.0, "decode_s": 1.0, "peak_rss_bytes": 1 << 30}
    s, cands = all_systems()["hf"], [Candidate(1, 1), Candidate(2, 2)]
    s.candidates = lambda w, max_batch: cands
    w = smoke(WORKLOADS["s512+128"])
    assert w.probe_gen_len == w.gen_len
    best = runner.search(s, w).best
    first, second = runner.final(s, w, best, 0), runner.final(s, w, best, 1)
    assert ran == [(1, 8, True), (1, 8, False)]                  # the probe, then only repeat 1 runs again
    assert first["probe"] is False and first["extra"]["reused_probe"] and "reused_probe" not in second["extra"]
    full = WORKLOADS["s512+128"]                                 # a real workload's 16-token probe is never reused
    runner.search(s, full)
    runner.final(s, full, Candidate(1, 1), 0)
    assert ran[-1] == (1, full.gen_len, False) and not runner.full_probes
    a.batch = parse_batches(["hf=4", "flexgen=32x8"])                # --batch: no search, no probe
    assert a.batch["flexgen"] == Candidate(256, 32, 8)
    n = len(ran)
    fixed = runner.search(s, full)
    assert fixed.best == Candidate(4, 4) and fixed.steps[0].status.startswith("best") and len(ran) == n


def test_overrides_rename_the_workload():
    w = overridden(WORKLOADS["gpu-opt30b-512+512"], "opt-6.7b", 64)
    assert (w.model, w.gen_len, w.prompt_len, w.probe_gen_len) == ("opt-6.7b", 64, 512, 16)
    assert w.name == "gpu-opt30b-512+512--opt-6.7b-gen64" and w.needs_gpu


@pytest.mark.parametrize("args, says", [(["--workload", "nope"], "unknown workload"),
                                        (["--systems", "nope"], "no system matches"),
                                        (["--uncached-weights", "--workload", "s512+32"], "needs a disk workload"),
                                        (["--batch", "flexgen=8y"], "expected SYSTEM=B"),
                                        (["--workload", "s512+32", "--batch", "ours-h2o=8"], "does not include"),
                                        (["--model", "opt-999"], "unknown model"),
                                        (["--gen-len", "1"], "at least 2 tokens")])
def test_bad_suite_input_is_one_line_and_exit_2(tmp_path, capsys, args, says):
    from benchmarks.suite import main
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and err.startswith("error:") and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()                     # refused before measuring or writing anything
