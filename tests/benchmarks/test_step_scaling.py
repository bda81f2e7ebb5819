"""benchmarks/studies/step_scaling.py: the slope arithmetic and the target check (no timing is asserted)."""
import pytest

from benchmarks.studies.step_scaling import prompts_for, slope_and_error, summarize


def call(case, length, seconds, rep=0):
    return {"case": case, "length": length, "median_step_s": seconds, "repeat": rep}


def test_slope_is_least_squares_over_every_point():
    assert slope_and_error([(1000, 0.3), (2000, 0.4)])[0] == pytest.approx(1e-4)
    # two repeats per length: the line goes through their means
    assert slope_and_error([(1000, 0.2), (1000, 0.4), (3000, 0.5), (3000, 0.7)])[0] == pytest.approx(1.5e-4)


def test_target_uses_the_magnitude_of_the_ratio():
    full = [call("full", n, 0.3 + 1e-4 * n) for n in (1000, 2000, 3000)]
    flat = summarize(full + [call("h2o", n, 0.5 + 5e-6 * n) for n in (1000, 2000, 3000)])
    assert flat["slope_ratio"] == pytest.approx(0.05)
    assert flat["slope_target_met"]
    # a steep negative slope is drift, not flatness: it must not pass
    falling = summarize(full + [call("h2o", n, 0.5 - 5e-5 * n) for n in (1000, 2000, 3000)])
    assert falling["slope_ratio"] == pytest.approx(-0.5)
    assert not falling["slope_target_met"]
    assert falling["cases"]["h2o"]["median_step_s"][2000] == pytest.approx(0.4)


def test_prompts_are_distinct_windows_of_the_requested_length():
    stream = list(range(100))
    got = prompts_for(stream, 3, 40)
    assert [len(p) for p in got] == [40, 40, 40]
    assert [p[0] for p in got] == [0, 20, 40]


def test_standard_error_reflects_the_scatter():
    exact = [(n, 0.1 + 1e-4 * n) for n in (1000, 2000, 3000)]
    assert slope_and_error(exact)[1] == pytest.approx(0.0, abs=1e-12)
    noisy = [(1000, 0.2), (1000, 0.4), (2000, 0.3), (2000, 0.5), (3000, 0.4), (3000, 0.6)]
    slope, error = slope_and_error(noisy)
    assert slope == pytest.approx(1e-4)
    # residuals +-0.1 at every point: s^2 = 0.06 / 4, sum (x - mean)^2 = 4e6
    assert error == pytest.approx((0.06 / 4 / 4e6) ** 0.5)
