"""The choice study's sweep (benchmarks/studies/choice_check.py): one plan per compression choice, the best the
search ranks with it, and the largest uncompressed block, none twice; a plan's figure is the median of its runs."""
from __future__ import annotations

from benchmarks.studies.choice_check import _flags, _median_row, sweep


def _cand(pred, gbs=4, ngb=1, wb=None, kb=None, pct=(100, 0, 100, 0, 100, 0)):
    return {"percent": list(pct), "gpu_batch_size": gbs, "num_gpu_batches": ngb, "weight_bits": wb, "kv_bits": kb,
            "predicted_tok_s": pred}


def test_sweep_takes_each_compression_choices_best_and_the_largest_plain_block():
    cands = [_cand(50, wb=4), _cand(40), _cand(30, gbs=16), _cand(20, wb=4, gbs=16), _cand(10, kb=8),
             _cand(5, wb=4, kb=4)]
    got = sweep(cands)
    assert got == [cands[1], cands[0], cands[4], cands[2]]       # none/none, int4 w, int8 KV, the largest block
    assert _flags(cands[0]) == ["--percent", "100", "0", "100", "0", "100", "0", "--gpu-batch-size", "4",
                                "--num-gpu-batches", "1", "--weight-bits", "4"]
    assert sweep([_cand(40, gbs=16)]) == [_cand(40, gbs=16)]                   # the best is the largest: once


def test_a_plans_row_is_its_median_run_and_a_failed_run_does_not_count():
    runs = [{"rc": 0, "measured_tok_s": 3.0, "chosen": "x"}, {"rc": "timeout"}, {"rc": 0, "measured_tok_s": 5.0},
            {"rc": 0, "measured_tok_s": 4.5}]
    row = _median_row(runs)
    assert row["measured_tok_s"] == 4.5 and row["chosen"] == "x" and row["runs"] == runs
    assert _median_row([{"rc": 1}])["runs"] == [{"rc": 1}] and "measured_tok_s" not in _median_row([{"rc": 1}])
