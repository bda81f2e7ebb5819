"""The llama.cpp adapter: its names, the context sizing and the command, the cached build's marker (per CPU and
recipe), the skip without a build, and, where llama.cpp is built on this machine, a real case per GGUF type
through the adapter and its child (the tests that need the build skip with the command that builds it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.suite import run_child
from benchmarks.systems import Candidate, all_systems
from benchmarks.systems import llamacpp as lcs
from benchmarks.systems import llamacpp_build as build
from benchmarks.workloads import WORKLOADS, smoke

NAMES = ("llamacpp-f16", "llamacpp-q8_0", "llamacpp-q4_0")
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2      # K and V, 30 layers, 3 KV heads of 64, fp16


def test_names_and_defaults():
    systems = all_systems()
    assert all(n in systems for n in NAMES)
    s = systems["llamacpp-q4_0"]
    assert (s.kind, s.kv_grows, s.kv_precision) == ("q4_0", False, "fp16")
    assert all(n in WORKLOADS["s512+512"].systems and n in WORKLOADS["s2048+512"].systems for n in NAMES)


def test_context_is_padded_per_sequence_and_growth_counts_it():
    assert lcs.ctx_per_seq(512, 512) == 1024 and lcs.ctx_per_seq(512, 16) == 768 and lcs.ctx_per_seq(64, 8) == 256
    w = WORKLOADS["s512+512"]
    assert w.model_config().kv_bytes_per_token(2) == SMOLLM2_KV_BYTES_PER_TOKEN
    # a 16-token probe allocated 768 tokens per sequence, the full run 1024
    assert lcs.LlamaCpp().kv_growth_bytes(w, 4, 512 - 16) == 4 * 256 * SMOLLM2_KV_BYTES_PER_TOKEN


def test_command(tmp_path):
    s = lcs.LlamaCpp("q8_0")
    s._gguf = tmp_path / "m.Q8_0.gguf"
    w = WORKLOADS["s512+128"]
    cmd = s.command(w, Candidate(8, 8), 128, tmp_path / "x.json", tmp_path)
    arg = lambda k: cmd[cmd.index(k) + 1]       # noqa: E731
    assert cmd[0].endswith("llamacpp_child.py") and s.python() == sys.executable
    assert arg("--bench").endswith("build/bin/llama-batched-bench") and arg("--model") == str(s._gguf)
    assert (arg("--batch"), arg("--prompt-len"), arg("--gen-len"), arg("--ctx")) == ("8", "512", "128", "6144")


def test_the_build_is_keyed_by_cpu_and_recipe(monkeypatch, tmp_path):
    monkeypatch.setattr("flexgen_h2o.weights.store_root", lambda: tmp_path)
    root = build.build_root()
    assert root.parent == tmp_path / "llamacpp" and root.name == f"{build.VERSION}-{build.cpu_key()}"
    assert "python -m benchmarks.systems.llamacpp_build" in build.missing_reason()
    for t in build.TOOLS:                        # tools without the marker: not ready (a killed build)
        build.tool_path(t).parent.mkdir(parents=True, exist_ok=True)
        build.tool_path(t).write_text("")
    assert build.missing_reason()
    (root / ".ready").write_text("0123456789abcdef src\n")         # another recipe's marker
    assert build.missing_reason()
    (root / ".ready").write_text(f"{build.RECIPE} src\n")
    assert build.missing_reason() is None


def test_quick_mode_skips_it_unbuilt_and_no_gguf_model_skips(monkeypatch, tmp_path):
    monkeypatch.setattr("flexgen_h2o.weights.store_root", lambda: tmp_path)
    s = lcs.LlamaCpp()
    reason = s.skip_reason(smoke(WORKLOADS["s512+128"]))
    assert reason and "not built" in reason and "llamacpp_build" in reason
    assert s.skip_reason(WORKLOADS["s512+128"]) is None          # a full run builds it in prepare
    assert "no GGUF" in s.skip_reason(WORKLOADS["disk512+128"])


def test_child_refuses_one_token(monkeypatch, tmp_path, capsys):
    from benchmarks.systems import llamacpp_child
    monkeypatch.setattr(sys, "argv", ["x", "--bench", "b", "--model", "m", "--prompt-len", "8", "--gen-len", "1",
                                      "--batch", "1", "--ctx", "256", "--json", str(tmp_path / "x.json")])
    assert llamacpp_child.main() == 2
    assert capsys.readouterr().err.startswith("error: --gen-len 1") and not (tmp_path / "x.json").exists()


built = pytest.mark.skipif(build.missing_reason() is not None, reason=str(build.missing_reason()))


@built
@pytest.mark.parametrize("kind", ["f16", "q4_0"])
def test_a_real_case(kind, tmp_path):
    """The adapter's whole path: the requantized GGUF (cached), the child, the JSON, the suite's row."""
    w = smoke(WORKLOADS["s512+128"])
    s = lcs.LlamaCpp(kind)
    assert s.prepare(w, {}, tmp_path) is None and s._gguf.is_file()
    written = s._gguf.stat().st_mtime_ns
    assert lcs.quantized_gguf(kind) == (s._gguf, None) and s._gguf.stat().st_mtime_ns == written    # written once
    c = Candidate(2, 2)
    json_path = tmp_path / "case.json"
    env = {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}
    raw, wall = run_child(sys.executable, s.command(w, c, 8, json_path, tmp_path), json_path, env,
                          tmp_path / "case.log", 300)
    row = s.normalize(raw, w, c, 8, wall_s=wall, threads=2, probe=False, repeat=0)
    assert raw["bench_line"]["pl"] == 2 and raw["bench_line"]["pp"] == 64 and raw["bench_line"]["tg"] == 7
    assert raw["flash_attn"] == 1 and raw["threads"] == 2 and raw["gguf_type"] == lcs.GGUF_TYPES[kind]
    # the f16 cache for 2 x 256 tokens, as llama.cpp printed it
    assert row["kv_bytes_per_seq"] == 256 * SMOLLM2_KV_BYTES_PER_TOKEN
    assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["peak_rss_bytes"] > 50 << 20
    assert json.loads(Path(json_path).read_text())["batch"] == 2
