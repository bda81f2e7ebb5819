"""benchmarks/studies/eviction_ab.py: the cache columns it times, and one tiny end-to-end run against HEAD."""
import json

from benchmarks.studies.eviction_ab import cache_columns, main


def test_columns_hold_heavy_past_a_consecutive_window_and_one_free_slot():
    pos, scores = cache_columns(batch=2, heads=3, heavy=5, recent=4, newest=40)
    assert pos.shape == scores.shape == (2, 3, 10)
    for column in pos.reshape(-1, 10).tolist():
        kept = sorted(p for p in column if p >= 0)
        assert column.count(-1) == 1 and len(set(kept)) == 9
        assert kept[-4:] == [37, 38, 39, 40] and max(kept[:-4]) < 37


def test_tiny_run_writes_both_timings(tmp_path, capsys):
    assert main(["--old-rev", "HEAD", "--batch", "2", "--heavy", "5", "--recent", "4", "--calls", "2",
                 "--repeats", "2", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert len(result["ms_per_layer"]["old"]) == len(result["ms_per_layer"]["new"]) == 2
    assert result["old_over_new"] > 0 and "victim choice per layer" in capsys.readouterr().out
