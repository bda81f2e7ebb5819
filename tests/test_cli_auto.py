"""`--percent auto` through the real CLI: this machine's rates measured once (then cached), the chosen plan and its
prediction printed before the run, the measurement beside it after and in the metrics JSON; a given placement
is predicted too once the rates exist; bad --percent values are refused. In this process (run.main), in a copy of
the tiny checkpoint's home, since the rates are cached there."""
from __future__ import annotations

import json

from tests.tiny_checkpoint import own_home, run_main


def test_auto_placement_is_chosen_predicted_and_measured(tiny, tmp_path):
    ckpt, env = tiny
    env = {**own_home(env, tmp_path), "FLEXGEN_H2O_CALIBRATE_SMOKE": "1"}   # short timings: the wiring is tested
    common = ["--model", str(ckpt), "--prompt-len", "16", "--gen-len", "4", "--gpu-batch-size", "4",
              "--offload-dir", str(tmp_path / "off")]
    metrics = tmp_path / "m.json"
    proc = run_main(common + ["--percent", "auto", "--metrics-json", str(metrics)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "calibrating this machine's rates" in out and "auto placement (--percent auto" in out, out
    assert "  chosen:  --percent " in out and "predicted" in out
    m = json.loads(metrics.read_text())
    assert m["predicted"]["total_tok_s"] > 0 and m["block_size"] <= 4
    from flexgen_h2o.planner.search import tok_s
    assert f"cost model: predicted {tok_s(m['predicted']['total_tok_s'])} tok/s, measured {tok_s(m['total_tok_s'])}" \
        in out
    assert tok_s(123.456) == "123.5" and tok_s(0.04891) == "0.0489"
    # the rates are cached: a given placement is predicted without measuring again
    again = run_main(common + ["--percent", "100", "0", "100", "0", "100", "0"], env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "calibrating" not in again.stdout and "cost model: predicted" in again.stdout
    assert not list((tmp_path / "off").glob("calibrate-*"))


def test_bad_percent_values_are_refused(tiny):
    ckpt, env = tiny
    for bad in (["1", "2", "3"], ["auto", "1"], ["a", "b", "c", "d", "e", "f"]):
        proc = run_main(["--model", str(ckpt), "--percent", *bad], env)
        assert proc.returncode == 2 and proc.stderr.startswith("error: --percent takes 6 numbers"), proc.stderr
