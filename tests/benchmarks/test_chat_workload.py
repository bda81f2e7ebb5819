"""The chat workload (issue 35, benchmarks/chat.py): its prompts are deterministic, mixed and of varying lengths,
every system reads the token ids our CLI computes, and a tiny job runs end to end."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from benchmarks.chat import answer_stats, suite_argv
from benchmarks.chat_prompts import KINDS, MAX_WORDS, MIN_WORDS, build_prompts, encode, request_line, spread


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
    from benchmarks.chat import build_job
    from flexgen_h2o.frontends.requests import read_requests
    from flexgen_h2o.loader import load_model
    from flexgen_h2o.schedule.blocks import encode_prompts
    job, meta = build_job(tmp_path, 5, 64)
    reqs = read_requests(job.input_jsonl, 128)
    assert [r.max_new_tokens for r in reqs] == [64] * 5 and [r.id for r in reqs] == [m["id"] for m in meta]
    tok = load_model("smollm2-135m", progress=False).tokenizer
    doc = json.loads(job.ids_json.read_text())
    assert doc["prompts"] == encode_prompts(tok, [r.messages for r in reqs], chat=False)
    assert doc["max_new_tokens"] == [64] * 5 and doc["eos_id"] == job.eos_id


def test_answer_stats_and_spread():
    st = answer_stats([3, 8, 8, 5], ["eos", "length", "eos", "eos"], 8)
    assert st["eos_share"] == 0.75 and st["hit_max_share"] == 0.25
    s = spread([1, 2, 3, 4, 5])
    assert (s["min"], s["median"], s["max"], s["p25"]) == (1, 3, 5, 2)


def test_suite_hands_the_chat_workload_over():
    assert suite_argv(["--workload", "chat", "--smoke"]) == ["--smoke"]
    assert suite_argv(["--smoke", "--workload=chat", "--repeats", "1"]) == ["--smoke", "--repeats", "1"]
    assert suite_argv(["--workload", "s512+32"]) is None and suite_argv([]) is None
    with pytest.raises(SystemExit):
        suite_argv(["--workload", "chat", "s512+32"])


def test_a_tiny_chat_job_runs_end_to_end(tmp_path):
    """ours-h2o-20 with and without refill, 4 prompts, 8 new tokens."""
    from benchmarks.chat import main
    systems = ["ours-h2o-20-norefill", "ours-h2o-20-refill"]
    assert main(["--smoke", "--systems", *systems, "--n-prompts", "4", "--max-new", "8",
                 "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "results.json").read_text())
    assert sorted(e["system"] for e in doc["systems"]) == sorted(systems)
    prompt_tokens = doc["job"]["prompt_tokens"]
    for e in doc["systems"]:
        assert e["status"] == "ran", e
        (r,) = e["runs"]
        assert r["n_prompts"] == 4 and len(r["lengths"]) == 4 and 1 <= r["batch"] <= 4
        assert r["generated_tokens"] == sum(r["lengths"]) and all(1 <= k <= 8 for k in r["lengths"])
        assert r["prompt_tokens"] >= 4 * prompt_tokens["min"]
        assert r["wall_s"] > 0 and r["tok_s"] > 0 and 0 < r["peak_rss_bytes"] < 4 << 30
        assert set(r["answer_len"]) >= {"min", "p10", "p25", "median", "p75", "p90", "max"}
        assert 0 <= r["eos_share"] <= 1 and 0 <= r["hit_max_share"] <= 1
        assert r["eos_share"] + r["hit_max_share"] == pytest.approx(1)
        assert r["extra"]["engine"]["generated_tokens"] == r["generated_tokens"]
        assert (r["extra"]["engine"]["refill_joins"] is None) == e["system"].endswith("norefill")
        assert e["summary"]["tok_s"] == r["tok_s"]
    md = (tmp_path / "results.md").read_text()
    assert "ours-h2o-20-norefill" in md and doc["command"] in md
    assert (tmp_path / "answer_lengths.png").stat().st_size > 1000
