"""eval.report's per-window streaming table: positions and ratios to the full cache, from the records alone."""
from flexgen_h2o.eval.report import item_ratio_table, window_table


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


def test_item_ratio_table_per_window_and_median():
    recs = {"wiki/full": {"policy": "full", "budget": "full", "item_ppl": [10.0, 20.0, 40.0]},
            "wiki/h2o@20%": {"policy": "h2o", "budget": "20%", "item_ppl": [11.0, 20.0, 80.0]},
            "wiki/local@20%": {"policy": "local", "budget": "20%", "item_ppl": [20.0, 30.0, 40.0]},
            "wiki/h2o@40%": {"policy": "h2o", "budget": "40%", "item_ppl": [10.0, 20.0, 40.0]},
            "lee/full": {"policy": "full", "budget": "full", "item_ppl": [1.0]}}
    header, rows = item_ratio_table(recs, "wiki/", "20%")
    assert header == ["window", "full ppl", "h2o", "local"]
    assert rows == [["0", "10.00", "1.100", "2.000"], ["1", "20.00", "1.000", "1.500"],
                    ["2", "40.00", "2.000", "1.000"], ["median", "20.00", "1.100", "1.500"]]
    assert item_ratio_table(recs, "lee/", "20%") == ([], [])          # no point at that budget
    assert item_ratio_table({"wiki/h2o@20%": recs["wiki/h2o@20%"]}, "wiki/", "20%") == ([], [])   # no full
