"""RULER's niah samples (as lm-eval 0.4.13 builds them), its metric, and the ruler task's scoring."""
from __future__ import annotations

import random
import re

import pytest

from flexgen_h2o.config import ConfigError
from flexgen_h2o.eval import ruler
from flexgen_h2o.eval.grid import GridPoint, parse_budget
from flexgen_h2o.eval.results import ResultStore
from flexgen_h2o.eval.runner import RunInfo

pytest.importorskip("wonderwords")
LENGTH = 1024


def test_key_words_equal_the_sorted_set_without_building_it():
    # prefix keys ("x-" / "x-rated-"), a space that sorts before "-", hyphens and mixed case in the nouns
    adjectives = ["x", "x-rated", "ad hoc", "ad", "blue", "blue-eyed", "Early", "old", "old", "zonked"]
    nouns = ["suit", "rated-cat", "zoot-suit", "ATM", "e-mail", "in-laws", "hoc", "a", "cat", "eyed-dog", "cat"]
    words = ruler.KeyWords(adjectives, nouns)
    expected = sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    assert len(words) == len(expected) and list(words) == expected
    with pytest.raises(IndexError):
        words[len(words)]


@pytest.mark.parametrize("task", list(ruler.NIAH_TASKS))
def test_samples_fit_the_length_and_hold_the_answer_once(tok, task):
    items = ruler.niah_samples(tok, task, LENGTH, 3, seed=0)
    assert len(items) == 3
    for it in items:
        # lm-eval's length: input tokens + the 128 left for the answer, as close to the limit as its lines allow
        assert it.length == len(tok(it.text).input_ids) + ruler.GEN_TOKENS
        assert 0.5 * LENGTH < it.length <= LENGTH
        assert len(it.prompt) + ruler.GEN_TOKENS <= LENGTH + 32                  # + the answer prefix
        assert tok.decode(it.prompt) == it.text + " " + it.gen_prefix
        assert len(it.answers) == 1 and it.text.count(it.answers[0]) == 1
        needle = f"One of the special magic {ruler.NIAH_TASKS[task].value} for {it.query} is: {it.answers[0]}."
        lines = it.text.split("\n")[1:-1]                                     # the haystack, one line a sentence
        at = lines.index(needle)
        assert lines.count(needle) == 1 and it.text.count(f"for {it.query} ") == 2   # needle, question
        # the needle sits at the recorded depth of the haystack
        assert abs(100 * at / (len(lines) - 1) - it.depth) <= 1
        if task == "niah_single_1":
            assert set(lines) - {needle} == {ruler.REPEAT_HAYSTACK}
        else:
            assert all(re.fullmatch(r"One of the special magic \w+ for \S+ is: \S+\.", x) for x in lines)


def test_samples_are_deterministic_for_a_seed(tok):
    a = ruler.niah_samples(tok, "niah_multikey_2", LENGTH, 2, seed=7)
    b = ruler.niah_samples(tok, "niah_multikey_2", LENGTH, 2, seed=7)
    c = ruler.niah_samples(tok, "niah_multikey_2", LENGTH, 2, seed=8)
    assert [x.prompt for x in a] == [x.prompt for x in b] and [x.prompt for x in a] != [x.prompt for x in c]
    assert a[0].answers != a[1].answers                      # one generator runs on across the samples
    with pytest.raises(ConfigError, match="no sample fits"):
        ruler.niah_samples(tok, "niah_single_1", 140, 1)


@pytest.mark.slow
def test_samples_equal_lm_evals(tok):
    """Where lm-eval (and its datasets, nltk, ...) is importable: the same samples after random.seed(seed),
    and the same 6.2M-word key list. Importing it is slow (its word list, an NLTK download attempt)."""
    prepare = pytest.importorskip("lm_eval.tasks.ruler.prepare_niah")
    from lm_eval.tasks.ruler.niah_utils import TEMPLATE
    assert TEMPLATE == ruler.TEMPLATE
    assert list(ruler.key_words()) == prepare.WORDS
    for task, cfg in ruler.NIAH_TASKS.items():
        for seed in (0, 5):
            random.seed(seed)
            theirs = prepare.generate_samples(prepare.get_haystack(type_haystack=cfg.haystack), TOKENIZER=tok,
                                              max_seq_length=LENGTH, template=TEMPLATE, type_haystack=cfg.haystack,
                                              type_needle_k=cfg.key, type_needle_v=cfg.value, num_samples=3)
            ours = ruler.niah_samples(tok, task, LENGTH, 3, seed=seed)
            assert [(d["index"], d["input"], d["outputs"], d["length"], d["gen_prefix"]) for d in theirs] == \
                [(x.index, x.text, x.answers, x.length, x.gen_prefix) for x in ours], (task, seed)


def test_string_match_all_is_rulers_metric():
    assert ruler.string_match_all("The number is 1234567.", ["1234567"]) == 1.0
    assert ruler.string_match_all("ABCDEF-12", ["abcdef-12", "999"]) == 0.5          # case-insensitive, a share
    assert ruler.string_match_all("123456", ["1234567"]) == 0.0
    assert ruler.postprocess_pred("  7\x00\t8 \n") == "7\n\n8"


class FakeRunner:
    """generate_grid as Runner's: the texts given per task (desc) and point, in item order."""

    def __init__(self, texts: dict[str, dict[str, list[str]]]):
        self.texts, self.calls = texts, 0

    def generate_grid(self, points, prompts, gen, checkpoint=None, desc=""):
        self.calls += 1
        assert gen.max_new_tokens == 128 and gen.greedy and gen.stop_at_eos
        return {p.key: ([[]] * len(prompts), self.texts[desc][p.key], RunInfo()) for p in points}


def test_run_ruler_scores_each_task_and_resumes(tmp_path):
    item = lambda t, a: ruler.RulerItem(t, 0, "", [a], "q", "p", 10, 50, [1, 2])      # noqa: E731
    items = {"niah_single_1": [item("niah_single_1", "1111111"), item("niah_single_1", "2222222")],
             "niah_multikey_3": [item("niah_multikey_3", "abc-def")]}
    points = [GridPoint("full"), GridPoint("h2o", parse_budget("20%"))]
    runner = FakeRunner({"niah_single_1": {"full": [" 1111111.\nx", "2222222"], "h2o@20%": ["1111111", "2222223"]},
                         "niah_multikey_3": {"full": ["nothing"], "h2o@20%": [" ABC-DEF"]}})
    store = ResultStore(tmp_path, "ruler", {"x": 1})
    ruler.run_ruler(runner, store, items, points, 128)
    assert store.get("niah_single_1/full")["score"] == 1.0 and store.get("niah_single_1/h2o@20%")["score"] == 0.5
    assert store.get("niah_multikey_3/full")["score"] == 0.0 and store.get("niah_multikey_3/h2o@20%")["score"] == 1.0
    assert store.get("niah_single_1/full")["outputs"][0] == "1111111.\nx"
    ruler.run_ruler(runner, ResultStore(tmp_path, "ruler", {"x": 1}), items, points, 128)
    assert runner.calls == 2                                                 # the rerun found every record


def test_missing_wonderwords_is_one_error_line(monkeypatch, capsys, tmp_path):
    from flexgen_h2o.eval.cli import main
    monkeypatch.setitem(__import__("sys").modules, "wonderwords", None)      # import fails
    assert main(["--tasks", "needle,ruler", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "wonderwords" in err and "pip install" in err
    assert main(["--tasks", "ruler", "--ruler-tasks", "niah_single_2", "--out", str(tmp_path)]) == 2
    assert "--ruler-tasks takes" in capsys.readouterr().err
