"""kvpress-decoding-20 (kvpress's decode-time eviction at ours-h2o-20's slot count): the target size taken from the
workload's prompt, the command the adapter builds (and that the child's own parser accepts), the prefill ratio
that keeps exactly the target, the child JSON mapping, and the bounded cache's growth. The child runs only in the
slow test, with the kvpress virtualenv."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from dataclasses import replace

import pytest

from benchmarks.systems import Candidate
from benchmarks.systems import kvpress as kvp
from benchmarks.systems.kvpress import KVPress, KVPressDecoding, h2o_budget
from benchmarks.workloads import WORKLOADS, smoke


def load_child():
    spec = importlib.util.spec_from_file_location("kvpress_child_under_test", kvp.CHILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def raw_child_json(**over):
    raw = {"batch": 8, "prompt_len": 512, "gen_len": 32, "prefill_s": 10.0, "decode_s": 31.0,
           "step_times_s": [1.0] * 31, "peak_rss_bytes": 2 << 30, "peak_rss_prefill_bytes": 2 << 30,
           "kv_bytes_per_seq": 4_700_160.0,
           "kv_tokens_per_seq": 102, "kv_tokens_range": [102, 102], "press": "ObservedAttentionPress",
           "compression_ratio": None, "attn_implementation": "eager", "threads": 2,
           "transformers_version": "5.2.0", "kvpress_version": "0.5.5", "target_size": 102,
           "decode_press_s": 3.0, "kv_tokens_max_decode": 102,
           "press_config": {"mode": "prefill+decoding", "decoding_press": {"target_size": 102}}}
    return {**raw, **over}


def test_target_size_is_ours_h2o_budget_from_the_prompt():
    s = KVPressDecoding(20)
    assert s.name == "kvpress-decoding-20" and s.press == "observed"
    assert s.target_size(WORKLOADS["s512+128"]) == 102          # 51 heavy + 51 recent
    assert s.target_size(WORKLOADS["s512+1024"]) == 102         # the prompt alone sets it, not gen_len
    assert s.target_size(WORKLOADS["s2048+512"]) == 408         # 2 * int(204.8)
    assert s.target_size(smoke(WORKLOADS["s512+32"])) == 12
    assert [h2o_budget(WORKLOADS["s512+128"], b) for b in (10, 40)] == [50, 204]
    # the same slots as the engine resolves for ours-h2o-20 (hh_ratio 0.1, recent = heavy)
    from flexgen_h2o.kv import EvictionConfig
    from benchmarks.systems.ours import Ours
    for w in (WORKLOADS["s512+128"], WORKLOADS["s2048+512"], replace(WORKLOADS["s512+128"], prompt_len=777)):
        b = EvictionConfig(policy="h2o", hh_ratio=Ours(20).hh_ratio).resolve(w.prompt_len, w.gen_len)
        assert s.target_size(w) == b.heavy + b.recent == b.capacity - 1


def test_command_asks_the_child_for_decoding_mode(tmp_path):
    s = KVPressDecoding(20)
    w = WORKLOADS["s512+128"]
    s._ids[w.name] = tmp_path / "ids.json"
    cmd = s.command(w, Candidate(8, 8), 32, tmp_path / "x.json", tmp_path)
    assert cmd[0].endswith("kvpress_child.py") and s.python().endswith("venvs/kvpress/bin/python")
    opt = {k: v for k, v in zip(cmd[1::2], cmd[2::2])}
    assert opt["--press"] == "ObservedAttentionPress" and opt["--target-size"] == "102"
    assert opt["--compression-interval"] == "1" and opt["--hidden-states-buffer-size"] == "0"
    assert opt["--batch"] == "8" and opt["--gen-len"] == "32" and opt["--warmup"] == "1"
    assert "--compression-ratio" not in cmd and len(cmd) == 1 + 2 * len(opt)
    every8 = KVPressDecoding(20, compression_interval=8)
    every8._ids[w.name] = tmp_path / "ids.json"
    cmd8 = every8.command(w, Candidate(8, 8), 32, tmp_path / "x.json", tmp_path)
    assert cmd8[cmd8.index("--compression-interval") + 1] == "8"
    # the child's own parser takes it: decoding mode with the target, the prefill-only ratio left unused
    a = load_child().make_parser().parse_args(cmd[1:])
    assert (a.target_size, a.compression_interval, a.hidden_states_buffer_size) == (102, 1, 0)
    # the prefill-only peers' command is unchanged
    obs = KVPress("observed", 20)
    obs._ids[w.name] = tmp_path / "ids.json"
    ocmd = obs.command(w, Candidate(8, 8), 32, tmp_path / "x.json", tmp_path)
    assert ocmd[ocmd.index("--compression-ratio") + 1] == "0.8" and "--target-size" not in ocmd
    assert load_child().make_parser().parse_args(ocmd[1:]).target_size is None


@pytest.mark.parametrize("prompt_len", [32, 64, 100, 511, 512, 777, 2048, 4096])
@pytest.mark.parametrize("pct", [10, 20, 40])
def test_prefill_ratio_keeps_exactly_the_target(prompt_len, pct):
    child = load_child()
    target = h2o_budget(replace(WORKLOADS["s512+128"], prompt_len=prompt_len), pct)
    ratio = child.prefill_ratio(prompt_len, target)
    assert 0 <= ratio < 1
    assert max(1, int(prompt_len * (1 - ratio))) == target     # kvpress.utils.compute_n_kept's rule
    assert child.prefill_ratio(10, 10) == 0.0 and child.prefill_ratio(10, 50) == 0.0    # nothing to evict


def test_press_config_in_the_child_json():
    child = load_child()
    a = child.make_parser().parse_args(["--store", "s", "--ids", "i", "--json", "j", "--target-size", "102"])
    cfg = child.press_config(a, 512)
    assert cfg["mode"] == "prefill+decoding" and cfg["wrapper"] == "PrefillDecodingPress"
    assert cfg["decoding_press"] == {"class": "DecodingPress", "base_press": "ObservedAttentionPress",
                                     "target_size": 102, "compression_interval": 1, "hidden_states_buffer_size": 0}
    assert cfg["prefilling_press"]["class"] == "ObservedAttentionPress"
    pre = child.press_config(child.make_parser().parse_args(["--store", "s", "--ids", "i", "--json", "j"]), 512)
    assert pre == {"mode": "prefill", "press": "ObservedAttentionPress", "compression_ratio": 0.8}


def test_child_metrics_and_the_normalized_row():
    s = KVPressDecoding(20)
    w = WORKLOADS["s512+128"]
    m = s.child_metrics(raw_child_json(), Candidate(8, 8))
    assert m["kv_tokens_per_seq"] == m["target_size"] == m["kv_tokens_max_decode"] == 102
    assert m["decode_press_s"] == 3.0 and m["press_config"]["mode"] == "prefill+decoding"
    assert m["kv_tokens_range"] == [102, 102] and m["attn_implementation"] == "eager"
    row = s.normalize(raw_child_json(), w, Candidate(8, 8), 32, wall_s=50.0, threads=2, probe=False, repeat=0)
    assert row["system"] == "kvpress-decoding-20" and row["kv_grows"] is False
    assert row["kv_bytes_per_seq"] == 4_700_160.0 and row["decode_tok_s"] == pytest.approx(8 * 31 / 31.0)
    assert row["extra"]["kv_tokens_per_seq"] == 102 and row["extra"]["decode_press_s"] == 3.0
    with pytest.raises(KeyError):           # a prefill-only child JSON is not a decoding run
        s.child_metrics({k: v for k, v in raw_child_json().items() if k != "target_size"}, Candidate(8, 8))


def test_bounded_cache_does_not_grow():
    w = WORKLOADS["s512+128"]
    per_token = w.model_config().kv_bytes_per_token(4)
    dec = KVPressDecoding(20)
    assert dec.kv_grows is False and dec.kv_fixed_tokens is True
    assert dec.kv_growth_bytes(w, 8, 112) == 0                       # interval 1: every step ends at target
    assert KVPressDecoding(20, compression_interval=8).kv_growth_bytes(w, 8, 112) == 8 * 7 * per_token
    assert KVPressDecoding(20, compression_interval=64).kv_growth_bytes(w, 2, 5) == 2 * 5 * per_token
    assert KVPress("observed", 20).kv_growth_bytes(w, 8, 112) == 8 * 112 * per_token     # prefill-only: grows
    with pytest.raises(ValueError):
        KVPressDecoding(20, compression_interval=0)


@pytest.mark.slow
def test_child_keeps_the_cache_at_target(tmp_path):
    """The real child in the kvpress venv: prompt 64, target 12, 10 tokens: every layer ends at 12."""
    from flexgen_h2o.weights import default_store_path
    py, store = kvp.venv_python(), default_store_path("smollm2-135m")
    if not (py.is_file() and (kvp.venv_dir() / ".ready").exists() and (store / "manifest.json").is_file()):
        pytest.skip("needs the kvpress virtualenv and the smollm2-135m store")
    w = smoke(WORKLOADS["s512+32"])
    ids = kvp.write_prompt_ids(w, 2, tmp_path / "ids.json")
    s = KVPressDecoding(20)
    s._ids[w.name] = ids
    cmd = s.command(w, Candidate(2, 2), 10, tmp_path / "out.json", tmp_path)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([str(py), *cmd], check=True, env=env, timeout=600)
    raw = json.loads((tmp_path / "out.json").read_text())
    assert raw["kv_tokens_per_seq"] == raw["kv_tokens_max_decode"] == raw["target_size"] == 12
    assert raw["kv_tokens_range"] == [12, 12] and raw["gen_len"] == 10 and raw["decode_press_s"] > 0
