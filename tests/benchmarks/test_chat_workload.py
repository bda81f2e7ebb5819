"""The suite's chat workload (benchmarks/chat_job.py): its prompts are deterministic, mixed and of varying lengths,
every system reads the token ids our CLI computes, each system sizes its batch by its own rule, and a tiny job runs
end to end through the suite."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from benchmarks.chat_job import (CHAT_KEYS, KINDS, MAX_WORDS, MIN_WORDS, ChatJob, answer_stats, build_prompts,
                                 chat_row, chat_summary, encode, request_line, spread)
from benchmarks.systems import Candidate, all_systems, select_systems
from benchmarks.workloads import GIB, WORKLOADS, select_workloads

MACHINE = {"date": "2026-11-21", "cpu": "test cpu", "threads": 2, "torch": "x",
           "gemm_decode_GFLOPs": {"1": 10.0, "8": 20.0, "64": 60.0}, "gemm_prefill_GFLOPs": 100.0,
           "gemm_prefill_rows": 2048, "memcpy_GBps": 20.0, "mem_read_GBps": 10.0, "disk_write_GBps": 1.0,
           "disk_read_GBps": 2.0, "disk_read_cold_fraction": 1.0, "gpu": None}


def test_prompts_are_deterministic_mixed_and_vary_in_length():
    a, b = build_prompts(60), build_prompts(60)
    assert a == b
    assert build_prompts(20) == a[:20]                      # a shorter job is a prefix of the longer one
    kinds = Counter(p.kind for p in a)
    assert set(kinds) == set(KINDS) and min(kinds.values()) == 20
    assert len({p.source for p in a}) >= 2
    words = [p.words for p in a]
    assert MIN_WORDS <= min(words) < 80 and 200 < max(words) <= MAX_WORDS
    assert len({p.text for p in a}) == len(a)
    for p in a:
        if p.kind == "summarize":
            assert p.text.startswith("Summarize this: ")
        elif p.kind == "continue":
            assert p.text.startswith("Continue this text: ")
        else:
            assert "?" in p.text
    line = request_line(a[0], 512)
    assert line == {"id": a[0].id, "messages": [{"role": "user", "content": a[0].text}], "max_new_tokens": 512}


def test_ids_are_the_engines_own_encoding():
    from flexgen_h2o.loader import load_model
    from flexgen_h2o.schedule.blocks import encode_prompts
    tok = load_model("smollm2-135m", progress=False).tokenizer
    prompts = build_prompts(9)
    ids = encode(tok, prompts)
    assert ids == encode_prompts(tok, [p.text for p in prompts], chat=True)
    # what the CLI's batch mode computes from the JSONL lines
    assert ids == encode_prompts(tok, [[{"role": "user", "content": p.text}] for p in prompts], chat=False)
    assert len({len(x) for x in ids}) > 5


def test_ids_file_matches_the_jsonl(tmp_path):
    from benchmarks.workloads import with_job
    from flexgen_h2o.frontends.requests import read_requests
    from flexgen_h2o.loader import load_model
    from flexgen_h2o.schedule.blocks import encode_prompts
    from dataclasses import replace
    w = with_job(replace(WORKLOADS["chat"], chat_prompts=5, gen_len=64), tmp_path)
    job = w.job
    reqs = read_requests(job.input_jsonl, 128)
    meta = json.loads((tmp_path / "prompts.json").read_text())
    assert [r.max_new_tokens for r in reqs] == [64] * 5 and [r.id for r in reqs] == [m["id"] for m in meta]
    tok = load_model("smollm2-135m", progress=False).tokenizer
    doc = json.loads(job.ids_json.read_text())
    assert doc["prompts"] == encode_prompts(tok, [r.messages for r in reqs], chat=False)
    assert doc["max_new_tokens"] == [64] * 5 and doc["eos_id"] == job.eos_id
    lens = [len(x) for x in doc["prompts"]]
    assert (w.prompt_len, job.longest, job.prompt_tokens, job.n_prompts) == (max(lens), max(lens), sum(lens), 5)


def test_answer_stats_spread_rows_and_summary():
    st = answer_stats([3, 8, 8, 5], ["eos", "length", "eos", "eos"], 8)
    assert st["eos_share"] == 0.75 and st["hit_max_share"] == 0.25
    s = spread([1, 2, 3, 4, 5])
    assert (s["min"], s["median"], s["max"], s["p25"]) == (1, 3, 5, 2)
    job = ChatJob("/nowhere", 4, 400, 130, 100, 2, 2)
    m = {"lengths": [3, 8, 8, 5], "finish": ["eos", "length", "eos", "eos"], "gen_s": 4.0, "peak_rss_bytes": GIB,
         "engine": {"blocks": 1}}
    rows = [chat_row("ours-h2o-20", "chat", job, 8, (4, 4, 1), m, wall_s=w, threads=2, repeat=i)
            for i, w in enumerate((6.0, 8.0))]
    assert set(CHAT_KEYS) <= set(rows[0]) and rows[0]["extra"] == {"engine": {"blocks": 1}}
    assert rows[0]["generated_tokens"] == 24 and rows[0]["tok_s"] == 4.0 and rows[0]["gen_tok_s"] == 6.0
    summ = chat_summary(rows)
    assert summ["tok_s"] == 3.5 and summ["runs_tok_s"] == [4.0, 3.0] and summ["repeats"] == 2
    with pytest.raises(ValueError, match="answered 3 of 4"):
        chat_row("hf", "chat", job, 8, (4, 4, 1), {**m, "lengths": [1, 2, 3]}, wall_s=1.0, threads=2, repeat=0)


def test_the_chat_workload_runs_the_suites_own_systems(tmp_path):
    """One harness: the chat systems are the suite's, each with a chat command and a batch rule; the peers
    without a chat mode are rows with the reason; --no-refill is a chat variant only."""
    from dataclasses import replace
    systems = all_systems()
    w = WORKLOADS["chat"]
    assert set(w.systems) <= set(systems) and w.is_chat and w.gen_len == 512 and w.chat_prompts == 200
    assert select_systems(["ours-h2o"], (), list(systems)) == ["ours-h2o-10", "ours-h2o-20", "ours-h2o-40"]
    smoke = select_workloads(["chat"], True)[0]
    assert (smoke.chat_prompts, smoke.gen_len, smoke.max_batch) == (12, 32, 4)
    assert not any(s.startswith("openvino") for s in smoke.systems) and "ours-norefill-h2o-20" in smoke.systems
    assert systems["ours-norefill-full"].skip_reason(WORKLOADS["s512+512"])
    assert systems["ours-norefill-full"].skip_reason(w) is None
    assert not systems["kvpress-observed-20"].runs_chat and not systems["vllm"].runs_chat
    job = ChatJob(str(tmp_path), 200, 60000, 540, 300, 2, 2)
    w = replace(w, prompt_len=540, job=job)
    ours = systems["ours-norefill-h2o-20"].command(w, Candidate(64, 64), 512, tmp_path / "r.json", tmp_path)
    assert ours[ours.index("--input") + 1] == str(job.input_jsonl) and "--no-refill" in ours
    assert "--prompt-len" not in ours and ours[ours.index("--hh-ratio") + 1] == "0.1"
    assert "--no-refill" not in systems["ours-h2o-20"].command(w, Candidate(64, 64), 512, tmp_path / "r.json", tmp_path)
    ov = systems["openvino-evict-20-f16"]
    cmd = ov.command(w, Candidate(16, 16), 512, tmp_path / "r.json", tmp_path)
    assert cmd[cmd.index("--chat") + 1] == str(job.ids_json) and "--ids" not in cmd
    assert cmd[cmd.index("--snapkv-window") + 1] == "540"                # every prompt query scored
    hf = systems["hf"].command(w, Candidate(16, 16), 512, tmp_path / "r.json", tmp_path)
    assert hf[hf.index("--chat") + 1] == str(job.ids_json)
    # each batch rule fits the budget, and H2O's fixed-size cache fits more sequences than the full one
    rules = {n: systems[n].chat_batch(w) for n in ("ours-full", "ours-h2o-20", "openvino-f16", "hf")}
    assert all(c is not None and (c.predicted_bytes or 0) <= w.budget_bytes for c, _ in rules.values())
    assert rules["ours-h2o-20"][0].batch > rules["ours-full"][0].batch and rules["hf"][0].batch == 16
    assert "planner at prompt 540 + gen 512" in rules["ours-full"][1]
    tiny = replace(w, budget_bytes=GIB // 4)
    assert systems["ours-full"].chat_batch(tiny)[0] is None


def test_a_tiny_chat_job_runs_end_to_end(tmp_path):
    """ours-h2o-20 with and without refill, 4 prompts, 8 new tokens, through `python -m benchmarks.suite`."""
    from benchmarks.suite import main
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps(MACHINE))
    systems = ["ours-norefill-h2o-20", "ours-h2o-20"]
    out = tmp_path / "out"
    assert main(["--workload", "chat", "--smoke", "--systems", *systems, "--chat-prompts", "4", "--gen-len", "8",
                 "--machine-json", str(machine), "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    (wl,) = doc["results"]
    job = wl["workload"]["job"]
    assert sorted(e["system"] for e in wl["systems"]) == sorted(systems) and job["n_prompts"] == 4
    for e in wl["systems"]:
        assert e["status"] == "ran", e
        (r,) = e["runs"]
        assert r["n_prompts"] == 4 and len(r["lengths"]) == 4 and 1 <= r["batch"] <= 4
        assert r["generated_tokens"] == sum(r["lengths"]) and all(1 <= k <= 8 for k in r["lengths"])
        assert r["prompt_tokens"] == job["prompt_tokens"] and r["max_new_tokens"] == 8
        assert r["wall_s"] > 0 and r["tok_s"] > 0 and 0 < r["peak_rss_bytes"] < 4 << 30
        assert set(r["answer_len"]) >= {"min", "p10", "p25", "median", "p75", "p90", "max"}
        assert 0 <= r["eos_share"] <= 1 and 0 <= r["hit_max_share"] <= 1
        assert r["eos_share"] + r["hit_max_share"] == pytest.approx(1)
        assert r["extra"]["engine"]["generated_tokens"] == r["generated_tokens"]
        assert (r["extra"]["engine"]["refill_joins"] is None) == ("norefill" in e["system"])
        assert e["summary"]["tok_s"] == r["tok_s"] and "roofline" not in e
        assert e["search"][0]["status"].startswith("best (planner at prompt")
    md = (out / "results.md").read_text()
    assert "ours-norefill-h2o-20" in md and doc["command"] in md and "Refill against none" in md
    assert (out / f"answers_{wl['workload']['name']}.png").stat().st_size > 1000
