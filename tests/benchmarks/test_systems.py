"""The adapters' pure parts: the planner-led candidates, the commands they build, the kvpress venv's failure
path (pip's own error line as the reason), and FlexGen's log parser. No system runs here."""
from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

from benchmarks.systems import Candidate, all_systems
from benchmarks.systems import kvpress as kvp
from benchmarks.systems.flexgen import parse_log
from benchmarks.systems.ours import plan_candidates
from benchmarks.workloads import GIB, WORKLOADS, smoke


def test_plan_candidates_take_the_largest_batch_that_fits():
    cands = plan_candidates(lambda b: 100 + 10 * b, budget=500, max_batch=64)   # 40 fits, 42 does not
    assert [c.batch for c in cands] == [1, 2, 4, 8, 16, 32, 40, 42]
    assert all(c.gbs == c.batch and c.num_batches == 1 for c in cands)
    assert cands[-2].predicted_bytes <= 500 < cands[-1].predicted_bytes
    assert [c.batch for c in plan_candidates(lambda b: 10 * b, budget=10_000, max_batch=8)] == [1, 2, 4, 8]
    assert [c.batch for c in plan_candidates(lambda b: 900, budget=500, max_batch=8)] == [1]   # over: shown


def test_ours_uses_the_real_planner():
    s = all_systems()["ours-h2o-20"]
    cands = s.candidates(WORKLOADS["s2048+512"], 32)
    assert cands and all(c.predicted_bytes and c.gbs * c.num_batches == c.batch for c in cands)
    full = all_systems()["ours-full"].candidates(WORKLOADS["s2048+512"], 32)
    # H2O keeps 20 % of the prompt, so at least as many sequences fit the same 2 GiB
    fit = [c.batch for c in cands if c.predicted_bytes <= 2 * GIB]
    fit_full = [c.batch for c in full if c.predicted_bytes <= 2 * GIB]
    assert max(fit) >= max(fit_full)


def test_commands(tmp_path):
    systems = all_systems()
    w = smoke(WORKLOADS["disk512+128"])
    args = systems["ours-h2o-10"].command(w, Candidate(4, 2, 2), 8, tmp_path / "x.json", tmp_path)
    assert args[:2] == ["-m", "flexgen_h2o.run"] and "--dummy-weights" in args and "--no-warmup" in args
    assert args[args.index("--hh-ratio") + 1] == "0.05" and args[args.index("--percent") + 1] == "0"
    assert "--full-cache" in systems["ours-full"].command(w, Candidate(1, 1), 8, tmp_path / "x.json", tmp_path)
    acc = systems["accelerate"].command(w, Candidate(2, 2), 8, tmp_path / "x.json", tmp_path)
    assert acc[:2] == ["-m", "benchmarks.systems.accelerate_child"] and acc[acc.index("--batch") + 1] == "2"
    kv = systems["kvpress-streaming-40"]
    kv._ids["s"] = tmp_path / "ids.json"
    sw = smoke(WORKLOADS["s512+32"])
    kv._ids[sw.name] = tmp_path / "ids.json"
    cmd = kv.command(sw, Candidate(2, 2), 8, tmp_path / "x.json", tmp_path)
    assert cmd[0].endswith("kvpress_child.py") and cmd[cmd.index("--compression-ratio") + 1] == "0.6"
    assert cmd[cmd.index("--press") + 1] == "StreamingLLMPress"
    assert kv.python().endswith("venvs/kvpress/bin/python")


def test_kvpress_venv_failure_reason_is_pips_last_line(monkeypatch, tmp_path):
    def fake_run(cmd, capture_output, text):
        if "pip" in cmd:
            return SimpleNamespace(returncode=1, stdout="Collecting kvpress\n",
                                   stderr="ERROR: No matching distribution found for kvpress==0.5.5\n")
        Path(cmd[-1], "bin").mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(returncode=0, stdout="", stderr="")
    monkeypatch.setattr(subprocess, "run", fake_run)
    reason = kvp.ensure_venv(tmp_path / "venv", log=tmp_path / "log.txt")
    assert reason == "kvpress venv: ERROR: No matching distribution found for kvpress==0.5.5"
    assert not (tmp_path / "venv" / ".ready").exists() and "Collecting" in (tmp_path / "log.txt").read_text()


def test_flexgen_log_parser():
    log = ("model size: 2.443 GB\tcache size: 0.562 GB\thidden size (p): 0.008 GB\n"
           "peak gpu mem: 3.250 GB\tprojected: False\n"
           "prefill latency: 1.250 s\tprefill throughput: 409.600 token/s\n"
           "decode latency: 10.000 s\tdecode throughput: 12.700 token/s\n"
           "total latency: 11.250 s\ttotal throughput: 11.378 token/s\n")
    assert parse_log(log) == {"prefill_s": 1.25, "decode_s": 10.0, "peak_gpu_gib": 3.25}
