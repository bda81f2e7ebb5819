"""eval.report's per-window streaming table: positions and ratios to the full cache, from the records alone."""
from flexgen_h2o.eval.report import window_table


def test_window_table_positions_and_ratios_to_full():
    recs = {"full": {"window_ppl": [10.0, 20.0], "nll_curve": [0.0] * 100},
            "h2o@8": {"window_ppl": [11.0, 30.0], "nll_curve": [0.0] * 100}}
    header, rows = window_table(recs, prefill=28)
    assert header == ["window centre (token)", "full", "h2o@8"]
    assert rows == [["53", "10.00", "11.00 (1.100×)"], ["103", "20.00", "30.00 (1.500×)"]]


def test_window_table_without_full_has_no_ratios():
    header, rows = window_table({"sink@8": {"window_ppl": [5.0], "nll_curve": [0.0] * 4}}, prefill=0)
    assert rows == [["2", "5.00"]] and header == ["window centre (token)", "sink@8"]
    assert window_table({}, prefill=0) == (["window centre (token)"], [])
