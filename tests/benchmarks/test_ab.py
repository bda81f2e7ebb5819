"""benchmarks/studies/ab.py: the shared flags, the alternating order and the results.json every A/B writes."""
import json
from pathlib import Path

from benchmarks.studies import ab


def test_common_flags_and_their_defaults():
    p = ab.parser("some_study", "First paragraph.\n\nThe rest.")
    ab.add_common(p, "benchmarks/results/some_study", repeats=4, base="the other side")
    a = p.parse_args([])
    assert (a.repeats, a.threads, a.base, a.out) == (4, 2, None, Path("benchmarks/results/some_study"))
    assert p.prog == "python -m benchmarks.studies.some_study" and p.description == "First paragraph."
    assert p.parse_args(["--base", "abc", "--out", "x"]).base == "abc"
    plain = ab.parser("other", "Doc.")
    ab.add_common(plain, "out", repeats=2)
    assert not hasattr(plain.parse_args([]), "base")
    ab.add_old_rev(plain, "select.py")
    assert plain.parse_args(["--old-rev", "HEAD"]).old_rev == "HEAD"


def test_sides_alternate_per_repeat_within_each_case(capsys):
    order = []
    sides = {"old": lambda: order.append("old"), "new": lambda: order.append("new")}
    figures = ab.run_interleaved(["full", "h2o"], sides, 2, lambda case: float(len(order)),
                                 lambda case, side, x: f"{case} {side} {x:g}")
    assert order == ["old", "new", "old", "new", "new", "old", "new", "old"]
    assert figures == {"full-old": [1.0, 6.0], "full-new": [2.0, 5.0], "h2o-old": [3.0, 8.0], "h2o-new": [4.0, 7.0]}
    assert capsys.readouterr().out.splitlines()[:2] == ["full old 1", "full new 2"]


def test_time_interleaved_reverses_the_order_on_odd_repeats():
    order = []
    times = ab.time_interleaved({n: (lambda n=n: order.append(n)) for n in "abc"}, repeats=3, calls=2)
    assert order == list("aabbcc" "ccbbaa" "aabbcc")
    assert all(len(t) == 3 and all(x >= 0 for x in t) for t in times.values())


def test_timing_summary_and_write_timings(tmp_path, capsys):
    result = {"args": {}, **ab.timing_summary({"a": [2.0, 4.0, 3.0], "b": [1.0, 1.5, 2.0]}, "a")}
    assert result["median_ms"] == {"a": 3.0, "b": 1.5} and result["over_a"] == {"a": 1.0, "b": 0.5}
    ab.write_timings(tmp_path / "out", result, "a", "title", digits=1)
    assert json.loads((tmp_path / "out" / "results.json").read_text()) == result
    assert capsys.readouterr().out.strip() == "title: a 3.0 ms (1.00x), b 1.5 ms (0.50x)"


def test_module_at_loads_the_revisions_file_beside_the_working_trees():
    from flexgen_h2o.kv import select
    old = ab.module_at("HEAD", "flexgen_h2o/kv/select.py", "select_at_head")
    assert old is not select and old.__name__ == "select_at_head" and callable(old.argmin_score)
