"""The OpenVINO adapter's pure parts: the budget mapping onto CacheEvictionConfig (block rounding), the cache
sizing, the command, the venv's and the exporter's failure reasons, child_metrics on a fake child JSON, and the
child's own helper (the scheduler's token cap). No OpenVINO runs here."""
from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.systems import Candidate, all_systems
from benchmarks.systems import openvino as ovs
from benchmarks.systems import openvino_child as child
from benchmarks.workloads import WORKLOADS, smoke

VARIANTS = {"openvino": ("u8", None, "SUM", None), "openvino-f16": ("f16", None, "SUM", None),
            "openvino-evict-20": ("u8", 20, "SUM", None), "openvino-evict-20-f16": ("f16", 20, "SUM", None),
            "openvino-evict-20-normsum": ("u8", 20, "NORM_SUM", 0),
            "openvino-evict-20-snapkv": ("u8", 20, "NORM_SUM", 8)}


def test_names():
    assert {ovs.OpenVINO(*v).name: v for v in VARIANTS.values()} == VARIANTS
    assert set(VARIANTS) <= set(all_systems())
    assert not ovs.OpenVINO("u8").kv_grows and ovs.OpenVINO("u8", 20).kv_fixed_tokens
    # the report's KV column (base.System.kv_precision, from kv_dtype_bytes)
    assert (ovs.OpenVINO("u8").kv_precision, ovs.OpenVINO("f16", 20).kv_precision) == ("u8", "fp16")


def test_eviction_sizes_match_ours_budget_rounded_up_to_blocks():
    # ours-h2o-20 at 512: 51 heavy + 51 recent = 102 slots, no sinks
    s = ovs.eviction_sizes(512, 20)
    assert s == {"ours_slots": 102, "start_size": 32, "recent_size": 64, "max_cache_size": 128,
                 "evictable_size": 32, "snapkv_window_size": 512, "max_tokens_per_seq": 159}
    s = ovs.eviction_sizes(2048, 20)          # 204 + 204 = 408 slots
    assert (s["ours_slots"], s["recent_size"], s["max_cache_size"], s["evictable_size"]) == (408, 224, 416, 160)
    s = ovs.eviction_sizes(64, 20)            # 6 + 6: OpenVINO's minimum is one block in each of the 3 areas
    assert (s["start_size"], s["recent_size"], s["max_cache_size"]) == (32, 32, 96)
    for p in (64, 100, 512, 777, 2048):
        s = ovs.eviction_sizes(p, 20)
        assert all(s[k] % 32 == 0 for k in ("start_size", "recent_size", "max_cache_size"))
        assert s["max_cache_size"] >= s["ours_slots"] and s["recent_size"] >= int(0.1 * p)


def test_cache_blocks_cover_the_prompt_even_with_eviction():
    assert ovs.blocks_per_seq(512, 32, None) == 17                  # 544 tokens
    assert ovs.blocks_per_seq(512, 1024, None) == 48
    ev = ovs.eviction_sizes(512, 20)
    assert ovs.blocks_per_seq(512, 1024, ev) == 17                  # the whole prompt is cached before eviction
    assert ovs.blocks_per_seq(64, 8, ovs.eviction_sizes(64, 20)) == 3
    assert ovs.num_kv_blocks(8, 512, 32, None) == 8 * 18            # + one spare block per sequence


def test_kv_bytes_and_growth():
    w = WORKLOADS["s512+512"]
    cfg = w.model_config()
    assert ovs.kv_bytes_per_token(cfg, "f16") == 23040              # both measured from the pipeline's metrics
    assert ovs.kv_bytes_per_token(cfg, "u8") == 13680
    full, ev = ovs.OpenVINO("f16"), ovs.OpenVINO("f16", 20)
    # a 16-token probe holds 528 tokens (17 blocks); the 512-token run 1024 (32 blocks)
    assert full.kv_growth_bytes(w, 4, 512 - 16) == 4 * 15 * 32 * 23040
    assert ev.kv_growth_bytes(w, 4, 512 - 16) == 0


def test_command_and_skip(tmp_path):
    w = smoke(WORKLOADS["s512+32"])
    s = ovs.OpenVINO("u8", 20)
    s._ids[w.name] = tmp_path / "ids.json"
    cmd = s.command(w, Candidate(2, 2), 8, tmp_path / "x.json", tmp_path)
    arg = lambda k: cmd[cmd.index(k) + 1]       # noqa: E731
    assert cmd[0].endswith("openvino_child.py") and arg("--ir").endswith("-ov-fp32")
    assert (arg("--batch"), arg("--gen-len"), arg("--kv-precision")) == ("2", "8", "u8")
    assert (arg("--evict-start"), arg("--evict-recent"), arg("--evict-max")) == ("32", "32", "96")
    assert (arg("--evict-mode"), arg("--snapkv-window")) == ("SUM", "64")      # every prompt query scored
    for mode, window, want in (("NORM_SUM", 0, "0"), ("NORM_SUM", 8, "8")):
        v = ovs.OpenVINO("u8", 20, mode, window)
        v._ids[w.name] = tmp_path / "ids.json"
        cmd = v.command(w, Candidate(2, 2), 8, tmp_path / "x.json", tmp_path)
        assert (arg("--evict-mode"), arg("--snapkv-window")) == (mode, want)
    assert arg("--num-kv-blocks") == str(ovs.num_kv_blocks(2, 64, 8, ovs.eviction_sizes(64, 20)))
    full = ovs.OpenVINO("f16")
    full._ids[w.name] = tmp_path / "ids.json"
    cmd = full.command(w, Candidate(2, 2), 8, tmp_path / "x.json", tmp_path)
    assert "--evict-max" not in cmd and cmd[cmd.index("--kv-precision") + 1] == "f16"
    assert s.python().endswith("venvs/openvino/bin/python")
    assert s.skip_reason(w) is None and s.skip_reason(smoke(WORKLOADS["disk512+128"]))


def test_venv_failure_reason_is_pips_last_line(monkeypatch, tmp_path):
    def fake_run(cmd, capture_output, text):
        if "pip" in cmd:
            return SimpleNamespace(returncode=1, stdout="Collecting openvino-genai\n",
                                   stderr="ERROR: No matching distribution found for openvino-genai==2026.4.1.0\n")
        Path(cmd[-1], "bin").mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(returncode=0, stdout="", stderr="")
    monkeypatch.setattr(subprocess, "run", fake_run)
    reason = ovs.ensure_venv(tmp_path / "venv", log=tmp_path / "log.txt")
    assert reason == "openvino venv: ERROR: No matching distribution found for openvino-genai==2026.4.1.0"
    assert not (tmp_path / "venv" / ".ready").exists()


def test_prepare_keeps_the_venv_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(ovs.OpenVINO, "_prepared", {})
    monkeypatch.setattr(ovs, "ensure_venv", lambda log=None: "openvino venv: ERROR: boom")
    w = WORKLOADS["s512+32"]
    assert ovs.OpenVINO("u8").prepare(w, {}, tmp_path) == "openvino venv: ERROR: boom"
    assert ovs.OpenVINO("f16", 20).prepare(w, {}, tmp_path) == "openvino venv: ERROR: boom"   # tried once


def test_export_once_with_a_marker(monkeypatch, tmp_path):
    hf, dest = tmp_path / "hf", tmp_path / "formats" / "m-ov-fp32"
    hf.mkdir()
    (hf / ".ready").write_text("abc123\n")
    monkeypatch.setattr("benchmarks.model_formats.hf_folder", lambda model: hf)
    monkeypatch.setattr(ovs, "ir_dir", lambda model: dest)
    calls = []

    def fake_run(cmd, capture_output, text, env):
        calls.append(cmd)
        if len(calls) == 1:
            return SimpleNamespace(returncode=1, stdout="", stderr="Traceback\nRuntimeError: no task\n")
        out = Path(cmd[-1])
        out.mkdir(parents=True)
        (out / "openvino_model.xml").write_text("<net/>")
        return SimpleNamespace(returncode=0, stdout="", stderr="")
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert ovs.export_ir("m")[1] == "openvino IR export: RuntimeError: no task"
    assert not dest.exists()
    assert ovs.export_ir("m") == (dest, None) and (dest / ".ready").read_text() == "abc123\n"
    assert "text-generation-with-past" in calls[-1] and calls[-1][calls[-1].index("--weight-format") + 1] == "fp32"
    assert ovs.export_ir("m") == (dest, None) and len(calls) == 2       # cached: no third export
    (hf / ".ready").write_text("def456\n")                             # a rebuilt HF folder re-exports
    ovs.export_ir("m")
    assert len(calls) == 3


def test_child_metrics_and_normalize():
    raw = {"prefill_s": 2.0, "decode_s": 3.1, "peak_rss_bytes": 900 << 20, "step_times_s": [0.1] * 31,
           "kv_precision": "u8", "num_kv_blocks": 144, "kv_cache_bytes": 144 * 32 * 13680, "kv_tokens_per_seq": 128,
           "eviction": {"start_size": 32, "recent_size": 64, "max_cache_size": 128}, "max_cache_usage": 70.0,
           "prefill_steps": 1, "max_num_batched_tokens": 4096, "openvino_version": "2026.4.1",
           "openvino_genai_version": "2026.4.1.0", "threads": 2, "inference_precision": "bf16"}
    s, c = ovs.OpenVINO("u8", 20), Candidate(8, 8)
    m = s.child_metrics(raw, c)
    assert m["kv_bytes_per_seq"] == 144 * 32 * 13680 / 8 and m["eviction"]["max_cache_size"] == 128
    row = s.normalize(raw, WORKLOADS["s512+32"], c, 32, wall_s=9.0, threads=2, probe=False, repeat=0)
    assert row["system"] == "openvino-evict-20" and row["kv_grows"] is False
    assert row["prefill_tok_s"] == pytest.approx(8 * 512 / 2.0) and row["decode_tok_s"] == pytest.approx(8 * 31 / 3.1)
    assert row["extra"]["kv_precision"] == "u8" and row["extra"]["inference_precision"] == "bf16"
    assert row["extra"]["openvino_genai_version"] == "2026.4.1.0"


def test_child_helpers():
    assert child.batched_tokens(8, 512) == 4096                       # the whole batch's prompts in one step
    assert child.batched_tokens(64, 512) == child.TOKEN_CAP == 4096   # our engine's prefill chunk
    assert child.batched_tokens(4, 8192) == 8192                      # never less than one whole prompt
    assert child.batched_tokens(64, 512, cap=32768) == 32768
