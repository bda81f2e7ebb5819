"""--report-only --merge: one experiment's grid points, run as several processes, joined into one task file."""
from __future__ import annotations

import json

import pytest

from flexgen_h2o.config import ConfigError
from flexgen_h2o.eval.cli import main
from flexgen_h2o.eval.results import ResultStore, merge_results

META = {"length": 64, "streams": 2, "prefill": 8, "budget": "16", "windows": 4, "model_window": 32}


def _run(folder, records: dict, meta: dict = META, partials: dict | None = None) -> None:
    store = ResultStore(folder, "streaming", meta)
    store.records = records
    store.partials = partials or {}
    store.save()


def test_points_from_two_folders_land_in_one_file(tmp_path):
    _run(tmp_path / "a", {"full": {"ppl": 10.0}}, partials={"h2o@16": {"0": {"nll": [1.0]}}})
    _run(tmp_path / "b", {"h2o@16": {"ppl": 11.0}, "h2o@16+roll": {"ppl": 12.5}})
    assert merge_results(tmp_path / "out", [tmp_path / "a", tmp_path / "b"]) == ["streaming"]
    saved = json.loads((tmp_path / "out" / "streaming.json").read_text())
    assert saved["meta"] == META
    assert saved["records"] == {"full": {"ppl": 10.0}, "h2o@16": {"ppl": 11.0}, "h2o@16+roll": {"ppl": 12.5}}
    assert saved["partials"] == {}
    # a later run into the merged folder resumes from it like from any checkpoint
    assert ResultStore(tmp_path / "out", "streaming", META).has("h2o@16+roll")


def test_runs_of_other_settings_or_other_values_are_refused(tmp_path):
    _run(tmp_path / "a", {"full": {"ppl": 10.0}})
    _run(tmp_path / "b", {"h2o@16": {"ppl": 11.0}}, meta={**META, "length": 128})
    with pytest.raises(ConfigError, match="other settings"):
        merge_results(tmp_path / "out", [tmp_path / "a", tmp_path / "b"])
    _run(tmp_path / "c", {"full": {"ppl": 10.5}})
    with pytest.raises(ConfigError, match="differs"):
        merge_results(tmp_path / "out", [tmp_path / "a", tmp_path / "c"])
    assert not (tmp_path / "out").exists()                     # nothing half-written


def test_cli_merges_then_reports_and_rejects_merge_without_report_only(tmp_path, capsys):
    _run(tmp_path / "a", {})
    assert main(["--report-only", "--out", str(tmp_path / "out"), "--merge", str(tmp_path / "a")]) == 0
    assert (tmp_path / "out" / "streaming.json").is_file() and (tmp_path / "out" / "report.md").is_file()
    assert main(["--out", str(tmp_path / "out"), "--merge", str(tmp_path / "a")]) == 2
    assert "--merge goes with --report-only" in capsys.readouterr().err
    assert main(["--report-only", "--out", str(tmp_path / "out"), "--merge", str(tmp_path / "missing")]) == 2
