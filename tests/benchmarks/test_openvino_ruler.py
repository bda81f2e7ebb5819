"""benchmarks/studies/openvino_ruler.py's budget mapping and scoring glue: pure, no OpenVINO virtualenv needed."""
from __future__ import annotations

import pytest

from benchmarks.studies.openvino_ruler import answer_text, budget_slots, make_jobs, ov_sizes, score, table


@pytest.mark.parametrize("lens, label, slots", [
    ([1785, 1842], "10%", 197),        # round(0.1 * (1842 + 128)): niah_single_1's 10 % in ruler.json
    ([1800, 1866], "20%", 399),        # niah_multikey_2's 20 %
    ([1820, 1822], "10%", 195),        # niah_multikey_3's 10 %
])
def test_budget_slots_are_the_harness_slots(lens, label, slots):
    assert budget_slots(lens, label, 128) == slots


@pytest.mark.parametrize("slots, recent, max_cache", [
    (197, 128, 224),                   # ceil32(99), ceil32(197)
    (394, 224, 416),                   # ceil32(197), ceil32(394)
    (389, 224, 416),
    (195, 128, 224),                   # ceil32(98)
    (64, 32, 96),                      # ceil32(64) = 64 would leave no evictable block: raised to 32 + 32 + 32
])
def test_ov_sizes(slots, recent, max_cache):
    s = ov_sizes(slots, window=1800)
    assert (s["start_size"], s["recent_size"], s["max_cache_size"]) == (32, recent, max_cache)
    assert all(s[k] % 32 == 0 for k in ("start_size", "recent_size", "max_cache_size"))
    assert s["evictable_size"] == max_cache - 32 - recent >= 32
    assert s["max_cache_size"] >= slots                    # never fewer tokens than the harness's budget
    assert s["snapkv_window_size"] == 1800 and s["max_tokens_per_seq"] == max_cache + 31


def test_make_jobs_full_then_each_budget():
    prompts = {"a": [[5] * 1842, [6] * 1785], "b": [[7] * 1866]}
    jobs = make_jobs(prompts, ["10%", "20%"], 128)
    assert [j["name"] for j in jobs] == ["a/full", "a/evict@10%", "a/evict@20%", "b/full", "b/evict@10%",
                                         "b/evict@20%"]
    assert jobs[0]["eviction"] is None and jobs[0]["prompts"] is prompts["a"]
    ev = jobs[1]["eviction"]
    assert (ev["slots"], ev["recent_size"], ev["max_cache_size"], ev["snapkv_window_size"]) == (197, 128, 224, 1842)
    assert jobs[5]["eviction"]["slots"] == round(0.2 * (1866 + 128))


def fake_decode(ids):
    words = {1: "", 2: "", 10: " The", 11: " number", 12: " is", 13: ": 6057437", 14: ".", 15: "\x01", 16: " x"}
    return "".join(words[i] for i in ids)


def test_answer_text_drops_eos_and_postprocesses():
    assert answer_text([13, 14, 2], eos=2, decode=fake_decode) == ": 6057437."
    assert answer_text([16, 15, 16], eos=2, decode=fake_decode) == "x\n x"     # control chars become newlines
    assert answer_text([], eos=2, decode=fake_decode) == ""


def test_score_is_string_match_all():
    gens = [[13, 14, 2], [10, 11, 12, 2], [13, 16]]
    answers = [["6057437"], ["6057437"], ["6057437", "1234567"]]
    texts, scores = score(gens, answers, eos=2, decode=fake_decode)
    assert texts[1] == "The number is"
    assert scores == [1.0, 0.0, 0.5]


def test_table_has_mean_and_dashes_for_missing():
    ov = {"t1": {"full": 1.0, "evict@10%": 0.2}, "t2": {"full": 0.5, "evict@10%": 0.0}}
    ours = {"t1": {"full": 1.0, "h2o@10%": 0.1}, "t2": {"full": 0.3, "h2o@10%": 0.0}}
    md = table(ov, ours, ["10%"]).splitlines()
    assert md[0].startswith("| task | ov full | ov 10% | ours full | ours h2o@10% | ours local@10%")
    assert md[2].startswith("| t1 | 1.00 | 0.20 | 1.00 | 0.10 | - |")
    assert md[-1].startswith("| mean | 0.75 | 0.10 | 0.65 | 0.05 | - |")
