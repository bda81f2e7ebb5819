"""benchmarks/profile_decode.py: op grouping and the per-step arithmetic (no timing is asserted)."""
import argparse

import pytest

from benchmarks.profile_decode import group_of, grouped, markdown


def test_ops_fall_into_their_groups():
    assert group_of("aten::addmm") == group_of("aten::mm") == "GEMM (linear, matmul)"
    assert group_of("aten::_softmax").startswith("attention")
    assert group_of("aten::topk").startswith("select") and group_of("aten::index_put_").startswith("select")
    assert group_of("aten::_to_copy") == group_of("aten::copy_") == "copies and casts"
    assert group_of("aten::mul") == "element-wise and reductions"
    assert group_of("aten::view").startswith("other")


def test_grouped_sums_per_step_and_sorts_by_time():
    rows = [("aten::mm", 0.8, 40), ("aten::addmm", 0.4, 20), ("aten::copy_", 0.6, 100), ("aten::view", 0.2, 400)]
    g = grouped(rows, steps=4)
    assert [r["group"] for r in g] == ["GEMM (linear, matmul)", "copies and casts", "other (views, Python-side ops)"]
    assert g[0]["ms_per_step"] == pytest.approx(300.0) and g[0]["calls_per_step"] == pytest.approx(15)
    assert g[0]["share"] == pytest.approx(0.6) and sum(r["share"] for r in g) == pytest.approx(1.0)


def test_markdown_states_the_ratio_to_the_bound():
    case = {"step_ms_median": 400.0, "step_ms_profiled_median": 430.0, "bound_step_ms": 100.0,
            "bound_limit": "compute", "groups": grouped([("aten::mm", 1.0, 8)], 8),
            "top_ops": [{"op": "aten::mm", "ms_per_step": 125.0, "calls_per_step": 1}]}
    md = markdown({"cases": {"h2o": case}}, argparse.Namespace(model="m", batch=4, prompt_len=16, phase="decode"))
    assert "measured / bound 4.00x" in md and "| GEMM (linear, matmul) | 125.0 | 1 | 100 % |" in md
