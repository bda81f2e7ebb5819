"""The suite's batch search (benchmarks.suite.search_batch), driven by a fake probe: the order, the budget, the
planner's edge, the probe cap and the noise margin. No model runs here."""
from __future__ import annotations

from benchmarks.common import CaseFailed
from benchmarks.search import PLANNER_EDGE, SLOWER, search_batch
from benchmarks.suite_report import CAPPED_BEST
from benchmarks.systems import Candidate
from benchmarks.workloads import GIB


def _fake_probe(table):
    calls = []

    def probe(c):
        calls.append(c.batch)
        r = table[c.batch]
        if r == "fail":
            raise CaseFailed("exit 1: ...\nRuntimeError: boom")
        return r
    return probe, calls


def test_search_up_stops_at_budget_and_takes_the_fastest():
    cands = [Candidate(b, b) for b in (1, 2, 4, 8, 16)]
    probe, calls = _fake_probe({1: (5.0, 1 * GIB), 2: (9.0, 1 * GIB), 4: (12.0, 2 * GIB), 8: (20.0, 5 * GIB)})
    res = search_batch(cands, probe, 3 * GIB, order="up", max_probes=10)
    assert res.best.batch == 4 and calls == [1, 2, 4, 8]
    assert [s.status for s in res.steps] == ["ok", "ok", "best", "over budget (measured)"]


def test_search_up_stops_when_slower_and_on_failure():
    cands = [Candidate(b, b) for b in (1, 2, 4, 8)]
    probe, calls = _fake_probe({1: (5.0, 1), 2: (9.0, 1), 4: (6.0, 1), 8: (99.0, 1)})
    res = search_batch(cands, probe, GIB, order="up")
    assert res.best.batch == 2 and calls == [1, 2, 4] and res.steps[-1].status == "slower"
    probe, calls = _fake_probe({1: (5.0, 1), 2: "fail"})
    res = search_batch(cands, probe, GIB, order="up")
    assert res.best.batch == 1 and res.steps[-1].status.startswith("failed: RuntimeError: boom")


def test_search_up_says_when_the_probe_cap_ended_it():
    cands = [Candidate(b, b) for b in (1, 2, 4, 8, 16)]
    probe, calls = _fake_probe({1: (5.0, 1), 2: (9.0, 1), 4: (12.0, 1)})
    res = search_batch(cands, probe, GIB, order="up", max_probes=3)
    assert calls == [1, 2, 4] and res.best.batch == 4
    assert [s.status for s in res.steps] == ["ok", "ok", CAPPED_BEST] + ["not probed (probe cap)"] * 2
    # a slower probe ends it before the cap: a plain "best", even though candidates remain
    probe, calls = _fake_probe({1: (5.0, 1), 2: (9.0, 1), 4: (6.0, 1)})
    res = search_batch(cands, probe, GIB, order="up", max_probes=3)
    assert [s.status for s in res.steps][:2] == ["ok", "best"]


def test_search_down_uses_the_planner_and_the_probe_cap():
    cands = [Candidate(b, min(b, 4), max(1, b // 4), predicted_bytes=b * GIB // 4) for b in (1, 2, 4, 8, 16)]
    probe, calls = _fake_probe({8: (30.0, 1), 4: (20.0, 1), 2: (25.0, 1)})
    res = search_batch(cands, probe, 2 * GIB, order="down", max_probes=2)
    assert calls == [8, 4] and res.best.batch == 8                 # 16 rejected by the planner, 4 slower
    assert ("over budget (planner)", 16) in [(s.status, s.candidate.batch) for s in res.steps]
    one = search_batch(cands[:1], probe, GIB, order="down")
    assert one.best.batch == 1 and "not probed" in one.steps[0].status
    assert search_batch([Candidate(1, 1, predicted_bytes=9 * GIB)], probe, GIB).best is None


def test_search_down_probes_the_planners_edge_and_the_measurement_decides():
    budget = 2 * GIB
    edge = int(budget * 1.05)             # the planner's estimate runs ~5 % high on the disk shapes
    cands = [Candidate(2, 2, predicted_bytes=GIB), Candidate(4, 4, predicted_bytes=int(1.8 * GIB)),
             Candidate(5, 5, predicted_bytes=edge)]
    probe, calls = _fake_probe({5: (7.0, int(1.95 * GIB)), 4: (6.0, int(1.7 * GIB)), 2: (4.0, GIB)})
    res = search_batch(cands, probe, budget, order="down")
    assert calls[0] == 5 and res.best.batch == 5                   # measured under the budget: it wins
    probe, calls = _fake_probe({5: (7.0, int(2.1 * GIB)), 4: (6.0, int(1.7 * GIB)), 2: (4.0, GIB)})
    res = search_batch(cands, probe, budget, order="down")
    assert res.best.batch == 4
    assert ("over budget (measured)", 5) in [(s.status, s.candidate.batch) for s in res.steps]
    far = [*cands[:2], Candidate(5, 5, predicted_bytes=int(budget * (PLANNER_EDGE + 0.1)))]
    probe, calls = _fake_probe({4: (6.0, int(1.7 * GIB)), 2: (4.0, GIB)})
    res = search_batch(far, probe, budget, order="down")
    assert 5 not in calls and ("over budget (planner)", 5) in [(s.status, s.candidate.batch) for s in res.steps]
    # an edge candidate alone is still probed (it is over budget until measured), and its measurement decides
    probe, calls = _fake_probe({5: (7.0, int(2.1 * GIB))})
    res = search_batch(cands[2:], probe, budget, order="down")
    assert calls == [5] and res.best is None and res.steps[0].status == "over budget (measured)"


def test_search_goes_on_through_a_dip_within_the_noise_margin():
    """A probe a few per cent below the best is noise on this VM, not a turning point: the search continues and
    keeps the fastest; a drop beyond the margin still ends it."""
    cands = [Candidate(b, b) for b in (1, 2, 4, 8, 16)]
    dip = 10.0 * (SLOWER + 1) / 2                                  # inside the margin
    probe, calls = _fake_probe({1: (10.0, 1), 2: (dip, 1), 4: (14.0, 1), 8: (14.0 * SLOWER * 0.99, 1)})
    res = search_batch(cands, probe, GIB, order="up", max_probes=10)
    assert calls == [1, 2, 4, 8] and res.best.batch == 4
    assert [s.status for s in res.steps] == ["ok", "ok", "best", "slower"]
