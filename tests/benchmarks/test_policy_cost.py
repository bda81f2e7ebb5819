"""benchmarks/studies/policy_cost.py: one tiny run times every scoring policy on the same over-budget columns."""
import json

import pytest

from benchmarks.studies.policy_cost import POLICIES, main


def test_tiny_run_times_every_policy(tmp_path, capsys):
    assert main(["--batch", "2", "--heavy", "5", "--recent", "4", "--calls", "2", "--repeats", "2", "--threads", "1",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["ms_per_layer"]) == set(POLICIES) and all(len(t) == 2 for t in result["ms_per_layer"].values())
    med = result["median_ms"]
    assert all(result["over_h2o"][n] == pytest.approx(med[n] / med["h2o"]) and med[n] > 0 for n in POLICIES)
    assert set(result["victims_differ_from_h2o"]) == set(POLICIES)
    assert not (tmp_path / "results.json.tmp").exists()
    assert "victim choice per layer" in capsys.readouterr().out
