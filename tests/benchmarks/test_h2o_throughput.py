"""benchmarks/h2o_throughput.py: resuming finished cases and the target checks (no timing is asserted)."""
import json

from benchmarks.h2o_throughput import compare, reusable


def finished_case(tmp_path, args, metrics=None):
    path = tmp_path / "case.json"
    path.write_text(json.dumps(metrics if metrics is not None else {"step_times_s": [0.1], "total_tok_s": 1.0}))
    path.with_suffix(".log").write_text("/some/venv/bin/python " + " ".join(args) + "\n\nmodel: ...\n")
    return path


def test_a_case_is_reused_only_for_the_same_command(tmp_path):
    args = ["-m", "flexgen_h2o.run", "--model", "opt-1.3b", "--gen-len", "1024"]
    path = finished_case(tmp_path, args)
    assert reusable(path, args) == {"step_times_s": [0.1], "total_tok_s": 1.0}
    assert reusable(path, args[:-1] + ["512"]) is None                  # another setting
    assert reusable(tmp_path / "missing.json", args) is None
    assert reusable(finished_case(tmp_path, args, {"error": "killed"}), args) is None   # no step times: not a result


def summary(setting, case, slope, **rates):
    return {"setting": setting, "case": case, "slope_s_per_token": slope,
            **{k: rates.get(k, 1.0) for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s")}}


def test_targets_use_the_slope_magnitude_and_the_regimes_metric():
    rows = compare([summary("a:x", "full", 1e-4, decode_tok_s=10.0), summary("a:x", "h2o", -5e-5, decode_tok_s=31.0),
                    summary("b:y", "full", 1e-4, total_tok_s=2.0), summary("b:y", "h2o", 5e-6, total_tok_s=5.0)])
    a, b = rows
    assert a["slope_ratio"] == -0.5 and not a["slope_target_met"]        # falling steps are drift, not flat
    assert a["speedup_target_met"] and a["speedup_target"] == "decode_tok_s >= 3.0x"
    assert b["slope_target_met"] and b["speedup_total_tok_s"] == 2.5 and not b["speedup_target_met"]
