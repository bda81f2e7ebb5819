"""benchmarks/studies/profile_decode.py: op grouping and the per-step arithmetic (no timing is asserted)."""
import argparse

import pytest

from benchmarks.studies.profile_decode import OUTSIDE, group_of, grouped, markdown, named_kernels


def test_ops_fall_into_their_groups():
    assert group_of("aten::addmm") == group_of("aten::mm") == "GEMM (linear, matmul)"
    assert group_of("aten::_softmax").startswith("attention")
    assert group_of("aten::topk").startswith("select") and group_of("aten::index_put_").startswith("select")
    assert group_of("aten::_to_copy") == group_of("aten::copy_") == "copies and casts"
    assert group_of("aten::mul") == "element-wise and reductions"
    assert group_of("aten::view").startswith("other")
    assert group_of("csrc::half_linear") == "kernel: linear (half_linear)"
    assert group_of("csrc::commit_step").startswith("kernel: KV commit")


def test_the_compiled_kernels_profile_under_their_own_names(kernel):
    import torch
    from torch.profiler import profile
    from flexgen_h2o.kernels import build
    named = named_kernels(kernel)
    assert named.ext is not kernel.ext and build.load() is kernel.ext           # a wrapped copy; the build as it was
    x, w = torch.randn(3, 16), torch.randn(5, 16).half()
    with profile() as prof:
        out = named.linear(x, w)
    torch.testing.assert_close(out, x @ w.float().T)
    keys = {e.key: e.count for e in prof.key_averages()}
    assert keys.get("csrc::half_linear") == 1


def test_grouped_sums_per_step_and_sorts_by_time():
    rows = [("aten::mm", 0.8, 40), ("aten::addmm", 0.4, 20), ("aten::copy_", 0.6, 100), ("aten::view", 0.2, 400)]
    g = grouped(rows, steps=4)
    assert [r["group"] for r in g] == ["GEMM (linear, matmul)", "copies and casts", "other (views, Python-side ops)"]
    assert g[0]["ms_per_step"] == pytest.approx(300.0) and g[0]["calls_per_step"] == pytest.approx(15)
    assert g[0]["share"] == pytest.approx(0.6) and sum(r["share"] for r in g) == pytest.approx(1.0)


def test_markdown_states_the_ratio_to_the_bound():
    case = {"step_ms_median": 400.0, "step_ms_profiled_median": 430.0, "bound_step_ms": 100.0,
            "bound_limit": "compute", "groups": grouped([("aten::mm", 1.0, 8)], 8),
            "top_ops": [{"op": "aten::mm", "ms_per_step": 125.0, "calls_per_step": 1}],
            "timed": "self GPU", "busy_ms_per_step": 125.0, "outside_ms_per_step": None}
    md = markdown({"cases": {"h2o": case}}, argparse.Namespace(model="m", batch=4, prompt_len=16, phase="decode"))
    assert "measured / bound 4.00x" in md and "| GEMM (linear, matmul) | 125.0 | 1 | 100 % |" in md
    assert "self GPU time of all ops: 125.0 ms per decode step" in md and "share of self GPU |" in md
    assert OUTSIDE not in md
    case.update(timed="self CPU", outside_ms_per_step=75.0)
    md = markdown({"cases": {"h2o": case}}, argparse.Namespace(model="m", batch=4, prompt_len=16, phase="decode"))
    assert f"{OUTSIDE}: 75.0 ms" in md


def test_percent_places_the_weights_and_the_bound_counts_the_disk_share():
    from benchmarks.machine import bound
    from benchmarks.studies.profile_decode import offload_policy, step_bound
    from flexgen_h2o.models import resolve_model
    from benchmarks.studies.profile_decode import build_parser
    resident = offload_policy(argparse.Namespace(batch=8, percent=None))   # no --percent: all resident
    args = build_parser().parse_args(["--dummy-weights", "--batch", "8", "--percent", "0", "0", "100", "0", "100", "0"])
    on_disk = offload_policy(args)
    assert args.dummy_weights and offload_policy(build_parser().parse_args([])).tier_fractions("weights")[2] == 0
    assert resident.tier_fractions("weights")[2] == 0 and on_disk.tier_fractions("weights")[2] == 1
    assert on_disk.gpu_batch_size == 8 and on_disk.num_gpu_batches == 1
    machine = {"disk_read_GBps": 1.0, "mem_read_GBps": 100.0, "page_cache_read_GBps": 0.1,
               "mem_available_bytes": 1 << 40, "gemm_prefill_GFLOPs": 100.0, "gemm_decode_GFLOPs": {"8": 50.0}}
    cfg = resolve_model("opt-125m")
    n = cfg.n_params()
    got = step_bound(machine, cfg, "decode", 8, 64, kv_tokens=20, kv_bytes_per_seq=1e6, disk_share=1.0)
    want = bound(machine, cfg, batch=8, prompt_len=64, gen_len=2, kv_read_bytes_per_seq=1e6,
                 offloaded_weight_bytes=n * 2, resident_weight_bytes=0, kv_tokens=20)
    assert got["bound_step_ms"] == pytest.approx(1e3 * want["decode_step_s"])
    # a slow page cache here: the fp16 files bound the step, where fp32 weights from DRAM would not
    resident_bound = step_bound(machine, cfg, "decode", 8, 64, 20, 1e6)
    assert got["bound_limit"] == "io" and resident_bound["bound_limit"] == "compute"
    assert got["bound_step_ms"] == pytest.approx(1e3 * (n * 2 / 0.1e9 + 8 * 1e6 / 100e9))


def test_gemm_flops_reads_the_factors_from_the_input_shapes():
    from benchmarks.studies.profile_decode import gemm_flops
    assert gemm_flops("aten::mm", [[4096, 576], [576, 1536]]) == 2.0 * 4096 * 576 * 1536
    assert gemm_flops("aten::mm", [[128, 2048], [2048, 64], [128, 64]]) == 2.0 * 128 * 2048 * 64   # out= last
    assert gemm_flops("aten::bmm", [[9, 128, 64], [9, 64, 2048]]) == 2.0 * 9 * 128 * 64 * 2048
    assert gemm_flops("aten::addmm", [[1536], [4096, 576], [576, 1536], [], []]) == 2.0 * 4096 * 576 * 1536
    assert gemm_flops("aten::addmm_", [[128, 64], [128, 2048], [2048, 64], [], []]) == 2.0 * 128 * 2048 * 64
    assert gemm_flops("aten::mm", [[4, 5], [6, 7]]) == 0.0            # mismatched inner sizes: not a GEMM's
    assert gemm_flops("aten::add", [[4, 5], [4, 5]]) == 0.0


def test_shapes_flag_adds_the_gemm_table():
    from benchmarks.studies.profile_decode import build_parser, markdown
    a = build_parser().parse_args(["--phase", "prefill", "--shapes"])
    assert a.shapes
    entry = {"step_ms_median": 10.0, "step_ms_profiled_median": 11.0, "timed": "self CPU", "busy_ms_per_step": 9.0,
             "outside_ms_per_step": 1.0, "groups": [], "top_ops": [],
             "gemm_by_shape": [{"op": "aten::mm", "shapes": "[[4096, 576], [576, 1536]]", "ms_per_step": 60.0,
                                "calls_per_step": 1.0, "gflops": 120.8},
                               {"op": "aten::mm", "shapes": "[[1], [2]]", "ms_per_step": 1.0,
                                "calls_per_step": 2.0, "gflops": None}]}
    md = markdown({"cases": {"h2o": entry}}, a)
    assert "| `aten::mm` | [[4096, 576], [576, 1536]] | 60.0 | 1 | 120.8 |" in md
    assert "| `aten::mm` | [[1], [2]] | 1.0 | 2 | - |" in md


def test_gemm_by_shape_groups_a_real_profile():
    import torch
    from torch.profiler import profile
    from benchmarks.studies.profile_decode import gemm_by_shape
    a, b = torch.randn(256, 128), torch.randn(128, 192)   # big enough for a nonzero time
    with profile(record_shapes=True) as prof:
        for _ in range(3):
            torch.mm(a, b)
        torch.mm(b.t(), a.t())                          # a second shape
        torch.zeros(256, 192).addmm_(a, b)              # in place: the profiler's own FLOP count gives it 0
        torch.relu(a)                                   # not a GEMM: left out
    rows = {(r["op"], r["shapes"]): r for r in gemm_by_shape(prof, units=1)}
    assert rows[("aten::mm", "[[256, 128], [128, 192]]")]["calls_per_step"] == 3
    assert rows[("aten::mm", "[[192, 128], [128, 256]]")]["calls_per_step"] == 1
    assert rows[("aten::addmm_", "[[256, 192], [256, 128], [128, 192], [], []]")]["calls_per_step"] == 1
    assert not any(op == "aten::relu" for op, _ in rows)
    assert all(r["gflops"] > 0 for r in rows.values())
