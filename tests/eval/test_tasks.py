"""Task inputs, checkpoints, ROUGE helpers, and the CLI end to end on a tiny model with SmolLM2's tokenizer."""
from __future__ import annotations

import json

import pytest

from flexgen_h2o.config import ConfigError
from flexgen_h2o.eval import data
from flexgen_h2o.eval.cli import main
from flexgen_h2o.eval.results import BlockCheckpoint, ResultStore
from flexgen_h2o.eval.streaming import edge_ratio, window_ppl
from flexgen_h2o.eval.summarize import first_line, mean_rouge, rouge_scorer


def test_perplexity_items_have_exact_lengths(tok):
    for corpus in ("wiki", "lee"):
        items = data.perplexity_items(tok, corpus, 3, 100, 20)
        assert len(items) == 3 and all(len(p) == 100 and len(c) == 20 for p, c in items)
    with pytest.raises(ConfigError, match="Wikipedia articles"):
        data.perplexity_items(tok, "wiki", 5, 200_000, 10)


def test_summary_items_are_lead_sentence_tasks(tok):
    items = data.summary_items(tok, 3, 1024)
    for it in items:
        assert len(it.prompt) <= 1024 and it.shots >= 1
        text = tok.decode(it.prompt)
        assert text.startswith(data.SUMMARY_HEADER) and text.endswith("Summary:")
        article = data.lee_articles()[it.article]
        assert article.startswith(it.reference) and it.reference not in text.split("Article: ")[-1]


def test_needle_items(tok):
    items = data.needle_items(tok, 256, [10, 90], 2)
    assert len(items) == 4 and all(len(it.prompt) == 256 for it in items)
    for it in items:
        text = tok.decode(it.prompt)
        assert f"pass key is {it.key}" in text and tok.decode(it.answer).strip() == it.key
    shallow, deep = (tok.decode(it.prompt).index(it.key) for it in items[:2])
    assert shallow < deep


def test_stream_items(tok):
    streams = data.stream_items(tok, 2, 300)
    assert [len(s) for s in streams] == [300, 300] and streams[0] != streams[1]


def test_store_resumes_and_refuses_other_settings(tmp_path):
    store = ResultStore(tmp_path, "perplexity", {"items": 2})
    store.put("full", {"ppl": 3.0})
    assert ResultStore(tmp_path, "perplexity", {"items": 2}).get("full") == {"ppl": 3.0}
    with pytest.raises(ConfigError, match="items differ"):
        ResultStore(tmp_path, "perplexity", {"items": 3})
    assert not ResultStore(tmp_path, "perplexity", {"items": 3}, fresh=True).records


def test_block_checkpoints_survive_a_restart_until_the_point_is_done(tmp_path):
    store = ResultStore(tmp_path, "needle", {"items": 2})
    BlockCheckpoint(store, "wiki/").put("h2o@20%", 0, {"result": [1.5]})
    again = ResultStore(tmp_path, "needle", {"items": 2})            # a new process after a kill
    assert BlockCheckpoint(again, "wiki/").get("h2o@20%", 0) == {"result": [1.5]}
    assert BlockCheckpoint(again, "wiki/").get("h2o@20%", 1) is None
    assert BlockCheckpoint(again).get("h2o@20%", 0) is None         # prefixes keep corpora apart
    again.put("wiki/h2o@20%", {"ppl": 2.0})                         # the finished record replaces the blocks
    assert ResultStore(tmp_path, "needle", {"items": 2}).partials == {}


def test_rouge_and_stream_helpers():
    scorer = rouge_scorer()
    assert mean_rouge(scorer, ["the cat sat on the mat"], ["the cat sat on the mat"])["rouge2"] == 1.0
    assert first_line(" A summary.\nArticle: next") == "A summary."
    assert window_ppl([0.0] * 10, 5) == [1.0] * 5
    r = edge_ratio([1.0] * 10 + [2.0] * 10)
    assert r["last_over_first"] == pytest.approx(2.718281828, rel=1e-6)


CLI = ["--policies", "full,h2o,sink", "--budgets", "20%,100%,64", "--batch-size", "3", "--no-progress",
       "--ppl-items", "2", "--ppl-context", "48", "--ppl-continuation", "12",
       "--sum-items", "2", "--sum-prompt-len", "400", "--sum-gen-len", "6",
       "--stream-len", "540", "--stream-prefill", "500", "--stream-budget", "64", "--stream-policies", "full,h2o",
       "--stream-windows", "4", "--needle-len", "128", "--needle-depths", "10,90", "--needle-trials", "1"]


def test_cli_end_to_end_resume_and_report(tiny_folder, tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["--model", str(tiny_folder), "--path", str(tmp_path / "store"), "--out", str(out)] + CLI
    assert main(args) == 0
    res = {t: json.loads((out / f"{t}.json").read_text())["records"]
           for t in ("perplexity", "summarization", "streaming", "needle")}
    assert len(res["perplexity"]) == 2 * (1 + 2 * 3) and len(res["summarization"]) == 7
    # 100 % of the sequence holds everything: the same numbers as the full cache, bit for bit
    for corpus in ("wiki", "lee"):
        for p in ("h2o", "sink"):
            assert res["perplexity"][f"{corpus}/{p}@100%"]["ppl"] == res["perplexity"][f"{corpus}/full"]["ppl"]
    assert res["summarization"]["h2o@100%"]["summaries"] == res["summarization"]["full"]["summaries"]
    assert res["summarization"]["h2o@100%"]["vs_full"] == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    assert res["needle"]["sink@100%"]["answer_nll"] == res["needle"]["full"]["answer_nll"]
    assert res["perplexity"]["wiki/h2o@20%"]["blocks_evicting"] == 1
    assert set(res["streaming"]) == {"full", "h2o@64", "h2o@64+roll"}       # the 540-token stream passed 512
    report = (out / "report.md").read_text()
    assert "## Perplexity" in report and "## Needle" in report and "## Targets" in report
    assert "| window centre (token) | full | h2o@64 | h2o@64+roll |" in report
    assert all((out / f).is_file() for f in ("perplexity_wiki.png", "summarization_rouge2.png", "streaming.png",
                                             "needle.png"))
    capsys.readouterr()
    assert main(args) == 0                                                  # everything is checkpointed
    assert "resuming" in capsys.readouterr().out
    assert main(args[:-2] + ["--needle-trials", "2", "--tasks", "needle"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trials differ" in err


@pytest.mark.parametrize("bad,match", [(["--tasks", "ppl"], "unknown task ppl"),
                                       (["--budgets", "20%,abc"], "neither a percentage"),
                                       (["--ppl-items", "0"], "--ppl-items must be >= 1"),
                                       (["--needle-depths", "10,120"], "percents in 0..100"),
                                       (["--stream-len", "10", "--stream-prefill", "20"], "must exceed"),
                                       (["--heavy-share", "1.5"], "--heavy-share 1.5 is a fraction"),
                                       (["--model", "no-such-model", "--tasks", "needle"], "unknown model"),
                                       (["--frobnicate"], "unrecognized arguments")])
def test_bad_input_is_one_line_and_exit_2(bad, match, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(bad + ["--out", str(tmp_path)]))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err
