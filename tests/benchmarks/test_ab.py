"""benchmarks/studies/ab.py: the shared flags, the alternating order and the results.json every A/B writes."""
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


def test_sides_alternate_per_repeat_within_each_case(capsys):
    order = []
    sides = {"old": lambda: order.append("old"), "new": lambda: order.append("new")}
    figures = ab.run_interleaved(["full", "h2o"], sides, 2, lambda case: float(len(order)),
                                 lambda case, side, x: f"{case} {side} {x:g}")
    assert order == ["old", "new", "old", "new", "new", "old", "new", "old"]
    assert figures == {"full-old": [1.0, 6.0], "full-new": [2.0, 5.0], "h2o-old": [3.0, 8.0], "h2o-new": [4.0, 7.0]}
    assert capsys.readouterr().out.splitlines()[:2] == ["full old 1", "full new 2"]
