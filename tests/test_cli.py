"""`python -m flexgen_h2o.run` on the tiny local checkpoint (tests/conftest.py's `tiny`): benchmark mode, batch mode,
resume after SIGKILL, and every input error (one line, exit code 2, nothing written). In this process through
run.main (tests/tiny_checkpoint.py, run_main), but for the killed job and the run after it, which are the entry
point in subprocesses."""
from __future__ import annotations

import json
import os
import re
import signal
import sys

import pytest
import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.planner.job import padding_tokens, plan_blocks
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import resolve_model
from flexgen_h2o.planner import estimate
from tests.tiny_checkpoint import kill_once_written, run_cli, run_main

LOG_RE = [r"model size: ([\d.]+) GB\tcache size: ([\d.]+) GB\thidden size \(p\): ([\d.]+) GB",
          r"peak gpu mem: ([\d.]+) GB\tprojected: (True|False)",
          r"prefill latency: ([\d.]+) s\tprefill throughput: ([\d.]+) token/s",
          r"decode latency: ([\d.]+) s\tdecode throughput: ([\d.]+) token/s",
          r"total latency: ([\d.]+) s\ttotal throughput: ([\d.]+) token/s"]


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_benchmark_mode_log_and_json(tiny, tmp_path):
    ckpt, env = tiny
    log, mj = tmp_path / "bench.log", tmp_path / "m.json"
    log.write_text("earlier run\n")
    proc = run_main(["--model", str(ckpt), "--prompt-len", "24", "--gen-len", "6", "--hh-ratio", "0.25",
                    "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--percent", "50", "50", "0", "50", "0", "100",
                    "--offload-dir", str(tmp_path / "off"), "--log-file", str(log), "--metrics-json", str(mj)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "prompts: 4 x 24 tokens of Lee news corpus, tokenized" in out
    assert re.search(r"model size: [\d.]+ KiB fp16 \| KV cache: [\d.]+ KiB real, [\d.]+ KiB full cache \| hidden "
                     r"size \(prefill\): [\d.]+ KiB \(width 64\)", out)
    assert "KV cache: h2o, 12 slots/seq (6 heavy + 6 recent) = 40.0% of 24+6" in out
    assert re.search(r"memory: compute peak .* \| host peak .* \| disk peak .* \| process peak RSS [\d.]+ GiB "
                     r"\(measured run [\d.]+ GiB\)", out)
    m = json.loads(mj.read_text())
    fields = ["model", "block_size", "prompt_len", "gen_len", "hidden_size", "model_bytes", "kv_cache_bytes",
              "full_cache_bytes", "hidden_bytes", "peak_compute_bytes", "tier_peak_bytes", "peak_rss_bytes",
              "prefill_s", "decode_s", "total_s", "prefill_tok_s", "decode_tok_s", "total_tok_s", "projected",
              "warmup_s", "step_times_s", "weights_by_tier", "weights_bytes_read", "percent", "eviction",
              "generated_tokens", "kv_slots_per_seq"]
    assert not [f for f in fields if f not in m]
    assert (m["block_size"], m["prompt_len"], m["gen_len"], m["projected"]) == (4, 24, 6, False)
    assert m["generated_tokens"] == 4 * 6 and len(m["step_times_s"]) == 5 and m["warmup_s"] > 0
    assert m["decode_tok_s"] == pytest.approx(4 * 5 / m["decode_s"])
    assert m["total_tok_s"] == pytest.approx(4 * 6 / (m["prefill_s"] + m["decode_s"]))
    # the real (H2O) KV is what the planner predicts; the full cache keeps all 30 positions
    cfg = resolve_model(str(ckpt))
    off = OffloadPolicy.from_percent([50, 50, 0, 50, 0, 100], gpu_batch_size=2, num_gpu_batches=2)
    est = estimate(cfg, off, EvictionConfig(policy="h2o", hh_ratio=0.25), prompt_len=24, gen_len=6)
    assert m["kv_cache_bytes"] == est.kv_bytes and m["full_cache_bytes"] == est.full_kv_bytes
    assert m["kv_cache_bytes"] * 30 == m["full_cache_bytes"] * 13           # 12 slots + the current one
    assert m["tier_peak_bytes"]["disk"] >= est.bytes["disk"]["kv"] > 0        # half the sequences' KV on disk
    assert m["tier_peak_bytes"]["host"] >= est.bytes["host"]["kv"] + est.bytes["host"]["activations"]
    assert m["peak_rss_bytes"] >= m["peak_rss_run_bytes"] > 50 << 20
    # FlexGen's 5-line block, appended after what the file held, agreeing with the JSON
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier run" and len(lines) == 6
    vals = [re.fullmatch(rx, line).groups() for rx, line in zip(LOG_RE, lines[1:])]
    assert vals[1][1] == "False"
    assert float(vals[2][0]) == pytest.approx(m["prefill_s"], abs=1e-3)
    assert float(vals[3][1]) == pytest.approx(m["decode_tok_s"], abs=1e-3)
    assert float(vals[4][1]) == pytest.approx(m["total_tok_s"], abs=1e-3)
    assert lines[1:] == out.strip().splitlines()[-5:]
    assert os.listdir(tmp_path / "off") == []                                 # the run's subfolder is gone


def test_batch_mode_keeps_ids_order_and_counts(tiny, tmp_path):
    ckpt, env = tiny
    rows = [{"prompt": "The quick brown fox", "id": "fox"}, {"prompt": "ab", "max_new_tokens": 3},
            {"prompt": "A much longer prompt than all the others, to be bucketed alone", "id": 10},
            {"prompt": "hello world", "id": "hw", "max_new_tokens": 1}, {"prompt": "xyz"},
            {"prompt": "Another long prompt that sits in the same bucket as", "id": "long2"}]
    inp, out, mj = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl", tmp_path / "m.json"
    proc = run_main(["--model", str(ckpt), "--input", str(inp), "--output", str(out), "--gen-len", "5",
                    "--gpu-batch-size", "2", "--metrics-json", str(mj), "--seed", "1", "--no-refill"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["fox", 2, 10, "hw", 5, "long2"]         # input order; no id: line number
    assert [r["prompt"] for r in recs] == [r["prompt"] for r in rows]
    budgets = [5, 3, 5, 1, 5, 5]
    for r, n in zip(recs, budgets):
        assert r["prompt_tokens"] == len(r["prompt"])                        # one token per character
        assert r["completion_tokens"] == len(r["token_ids"])
        assert r["finish_reason"] in ("length", "eos")
        assert (r["completion_tokens"] == n) if r["finish_reason"] == "length" else (r["token_ids"][-1] == 2)
    m = json.loads(mj.read_text())
    lens = [len(r["prompt"]) for r in rows]
    assert (m["prompts"], m["blocks"], m["prompt_tokens"]) == (6, 3, sum(lens))
    assert m["generated_tokens"] == sum(r["completion_tokens"] for r in recs)
    # bucketing: the two long prompts share a block; far less padding than blocks in input order
    padded = m["padded_prompt_tokens"] - m["prompt_tokens"]
    assert padded == padding_tokens(plan_blocks(lens, 2, budgets), lens)
    assert padded < padding_tokens(plan_blocks(lens, 2, bucket=False), lens) / 2
    assert "wrote 6 results" in proc.stdout and "decode" in proc.stderr and "tok/s" in proc.stderr


def test_resume_after_sigkill(tiny, tmp_path):
    ckpt, env = tiny
    n = 16
    rows = [{"prompt": "Tell me about item number %d, please." % i + "!" * (i % 5) * 6, "id": f"q{i}"}
            for i in range(n)]
    inp, out = _jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    args = ["--model", str(ckpt), "--input", str(inp), "--output", str(out), "--gen-len", "48", "--gpu-batch-size",
            "1", "--no-progress", "--metrics-json", str(tmp_path / "m.json")]
    status = kill_once_written(args, out, env, tmp_path / "log1", lines=2)
    assert status == -signal.SIGKILL, (tmp_path / "log1").read_text()[-2000:]
    raw = out.read_bytes()
    assert raw.endswith(b"\n")                                                # no partial line
    before = [json.loads(x) for x in raw.decode().splitlines()]
    done = [r["id"] for r in before]
    assert len(set(done)) == len(done) and 2 <= len(done) < n, done        # killed mid-way, no duplicates
    proc2 = run_main(args, env)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert f"resuming {out}: {len(done)} of {n} ids already done" in proc2.stdout
    after = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in after] == [r["id"] for r in rows]               # all ids, once, in input order
    by_id = {r["id"]: r for r in after}
    assert all(by_id[r["id"]] == r for r in before)                          # kept, not regenerated
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["prompts"] == n - len(done)                                     # only the rest ran
    # a third run has nothing to do and leaves the file as it is: the entry point's exit status, in a subprocess
    proc3 = run_cli(args, env)
    assert proc3.returncode == 0 and "nothing to do" in proc3.stdout
    assert [json.loads(x) for x in out.read_text().splitlines()] == after


def test_resumed_sampling_gives_the_uninterrupted_tokens(tiny, tmp_path):
    """Sampling is seeded per id: ids generated after a resume, in other blocks and positions, sample exactly
    what the uninterrupted run sampled."""
    ckpt, env = tiny
    rows = [{"prompt": "Sample number %d." % i + " more" * (i % 3), "id": f"s{i}"} for i in range(6)]
    inp = _jsonl(tmp_path / "in.jsonl", rows)
    common = ["--model", str(ckpt), "--input", str(inp), "--gen-len", "12", "--gpu-batch-size", "2",
              "--temperature", "1.0", "--top-k", "20", "--seed", "3", "--no-progress"]
    full = tmp_path / "full.jsonl"
    assert run_main(common + ["--output", str(full)], env).returncode == 0
    want = [json.loads(x) for x in full.read_text().splitlines()]
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(json.dumps(want[i]) + "\n" for i in (4, 1)))       # two ids already done
    proc = run_main(common + ["--output", str(partial)], env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [json.loads(x) for x in partial.read_text().splitlines()] == want
    assert len({r["text"] for r in want}) > 1                                      # really sampled text


def _errors(tmp_path, ckpt):
    bad = _jsonl(tmp_path / "bad.jsonl", ['{"prompt": "fine"}', '{"prompt": "also fine", "id": 3}',
                                          '{"prompt": "broken'])
    long = _jsonl(tmp_path / "long.jsonl", [{"prompt": "short"}, {"prompt": "x" * 600}])
    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": "fine"}])
    out = str(tmp_path / "out.jsonl")
    m = ["--model", str(ckpt)]
    return [
        (["--model", "no-such-model"], "error: unknown model 'no-such-model': use a preset"),
        (["--percent", "100", "0", "120", "0", "100", "0"], "error: --percent cache_gpu=120 is outside 0..100"),
        (["--percent", "60", "50", "100", "0", "100", "0"], "error: --percent for weights sums to 110 > 100"),
        (["--percent", "100", "0", "100"], "error: --percent takes 6 numbers (W_GPU W_CPU"),
        (["--hh-ratio", "0"], "error: argument --hh-ratio: 0 is not in (0, 1]"),
        (["--hh-ratio", "1.5"], "error: argument --hh-ratio: 1.5 is not in (0, 1]"),
        (["--recent-ratio", "-0.1"], "error: argument --recent-ratio: -0.1 is not in (0, 1]"),
        (m + ["--input", str(long), "--output", out, "--gen-len", "8"],
         f"error: {long}: line 2: prompt (600 tokens) + max_new_tokens (8) exceed the context window (512)"),
        (m + ["--input", str(bad), "--output", out], f"error: {bad}: line 3: not valid JSON"),
        (m + ["--input", str(good), "--output", str(tmp_path / "missing" / "o.jsonl")],
         f"error: --output {tmp_path / 'missing' / 'o.jsonl'}: folder {tmp_path / 'missing'} does not exist"),
        (m + ["--input", str(good), "--output", str(tmp_path)], f"error: --output {tmp_path} is a directory"),
        (m + ["--input", str(good), "--output", str(good / "o.jsonl")],
         f"error: --output {good / 'o.jsonl'}: folder {good} does not exist"),
        (m + ["--metrics-json", str(tmp_path / "nope" / "m.json")], "error: --metrics-json"),
    ]


def test_errors_one_line_exit_2_nothing_written(tiny, tmp_path):
    ckpt, env = tiny
    for args, message in _errors(tmp_path, ckpt):
        before = sorted(os.listdir(tmp_path))
        proc = run_main(args + ["--metrics-json", str(tmp_path / "m.json"), "--log-file", str(tmp_path / "l.log")]
                        if "--metrics-json" not in args else args, env)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), (args, proc.stderr)
        assert proc.stdout == ""
        assert sorted(os.listdir(tmp_path)) == before, args                  # no output, log or metrics file


def test_hub_error_says_how_to_convert(tiny, tmp_path):
    ckpt, env = tiny
    env = dict(env, FLEXGEN_H2O_HOME=str(tmp_path / "home"))
    proc = run_main(["--model", "facebook/opt-13b", "--metrics-json", str(tmp_path / "m.json")], env)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: weights for facebook/opt-13b are not converted and cannot be downloaded")
    assert "python -m flexgen_h2o.convert /path/to/hf_folder --model facebook/opt-13b" in proc.stderr
    assert "--dummy-weights" in proc.stderr and proc.stderr.count("convert a local checkpoint") == 1
    assert not (tmp_path / "home").exists() and not (tmp_path / "m.json").exists()


def test_benchmark_context_error_in_process(tiny, capsys, monkeypatch):
    from flexgen_h2o import run
    ckpt, env = tiny
    monkeypatch.setenv("FLEXGEN_H2O_HOME", env["FLEXGEN_H2O_HOME"])
    rc = run.main(["--model", str(ckpt), "--prompt-len", "510", "--gen-len", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --prompt-len: prompt (510 tokens) + max_new_tokens (8) exceed the "
                                      "context window (512)") and len(err.strip().splitlines()) == 1


def test_projection_only_when_asked_in_process(tiny, tmp_path, capsys, monkeypatch):
    from flexgen_h2o import run
    from flexgen_h2o.frontends.benchmark import project_decode
    ckpt, env = tiny
    monkeypatch.setenv("FLEXGEN_H2O_HOME", env["FLEXGEN_H2O_HOME"])
    monkeypatch.chdir(tmp_path)
    rc = run.main(["--model", str(ckpt), "--prompt-len", "16", "--gen-len", "10", "--cut-gen-len", "5",
                   "--gpu-batch-size", "2", "--no-warmup", "--log-file", "auto", "--metrics-json", "m.json"])
    out = capsys.readouterr().out
    assert rc == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert (m["projected"], m["gen_len"], m["executed_gen_len"], m["generated_tokens"]) == (True, 10, 5, 10)
    assert m["warmup_s"] == 0 and len(m["step_times_s"]) == 4
    assert m["decode_s"] == pytest.approx(project_decode(m["step_times_s"], 10))
    assert m["decode_s"] != m["measured_decode_s"]
    assert m["decode_tok_s"] == pytest.approx(2 * 9 / m["decode_s"])
    assert "executed 5, decode projected" in out
    log = (tmp_path / "fo-tiny-gbs2-ngbs1-prompt16-gen10-percent-100-0-100-0-100-0-gpu-cache.log").read_text()
    assert log.splitlines()[1].endswith("projected: True")


def test_project_decode_formula():
    from flexgen_h2o.frontends.benchmark import project_decode
    # FlexGen: the first two decode steps as measured, the mean of the others for the remaining gen_len - 3
    assert project_decode([5.0, 3.0, 1.0, 2.0], 32) == pytest.approx(8.0 + 1.5 * 29)


@pytest.mark.parametrize("flags,policy", [
    ([], "h2o"), (["--h2o-variant", "port"], "h2o-port"), (["--h2o-variant", "avg"], "h2o-avg"),
    (["--policy", "sink"], "sink"),
])
def test_eviction_flags_name_the_policy(flags, policy):
    from flexgen_h2o.frontends.cli import build_parser, check_flags, eviction_from_args
    args = build_parser().parse_args(["--hh-ratio", "0.1"] + flags)
    check_flags(args)
    ev = eviction_from_args(args)
    assert (ev.policy, ev.hh_ratio) == (policy, 0.1)
    if flags:       # a variant or baseline without a budget would do nothing: refused (tests/test_cli_forms.py)
        with pytest.raises(ValueError, match="needs a KV budget"):
            check_flags(build_parser().parse_args(flags))
    assert eviction_from_args(build_parser().parse_args(flags)).policy == "full"     # no budget: no eviction


def test_warmup_adds_one_real_length_prefill_chunk_on_a_gpu_only():
    """FlexGen's 32-token warm-up everywhere; on a GPU first one prefill chunk at the real length (cuDNN plans
    per shape, allocator growth), so that one-time cost stays out of the measured prefill."""
    import types
    from flexgen_h2o.frontends.benchmark import warmup_blocks
    prompts = [list(range(r, r + 2048)) for r in range(40)]
    llm = types.SimpleNamespace(eviction=EvictionConfig(), offload=OffloadPolicy(gpu_batch_size=20, num_gpu_batches=2))
    cpu = warmup_blocks(prompts, llm, "cpu")
    assert len(cpu) == 1 and cpu[0] == [p[-32:] for p in prompts]
    gpu = warmup_blocks(prompts, llm, "cuda")
    assert gpu[1:] == cpu and gpu[0] == prompts[:8]           # 16384 prompt tokens of one GPU batch: 8 sequences
    short = [p[:16] for p in prompts]                         # already shorter than the warm-up length
    assert warmup_blocks(short, llm, "cuda") == [short]


def test_an_in_process_run_leaves_this_process_as_it_found_it(tiny, tmp_path):
    """run_main (the in-process CLI runs above) puts back the environment, the working folder, the torch threads
    and sys.stdout/stderr, so no test sees another's settings."""
    ckpt, env = tiny
    before = (dict(os.environ), os.getcwd(), torch.get_num_threads(), sys.stdout, sys.stderr)
    proc = run_main(["--model", str(ckpt), "--prompt", "hi", "--gen-len", "2", "--no-progress"],
                    dict(env, FLEXGEN_H2O_CALIBRATE_SMOKE="1"), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout, proc.stderr
    assert (dict(os.environ), os.getcwd(), torch.get_num_threads(), sys.stdout, sys.stderr) == before
