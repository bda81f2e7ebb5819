"""benchmarks/studies/commit_cost.py and benchmarks/studies/decode_ab.py: tiny runs time both sides of each
comparison (no timing is asserted) and check what they must check (the same cache state; one median per call and
side)."""
import json
import os

import pytest

from benchmarks.studies import ab, commit_cost, decode_ab, layer_math_cost, linear_cost


@pytest.mark.parametrize("policy", ["h2o", "h2o-avg", "h2o-port"])
def test_commit_cost_times_both_commits_and_finds_the_same_cache(kernel, tmp_path, capsys, policy):
    assert commit_cost.main(["--batch", "3", "--heavy", "6", "--recent", "5", "--calls", "3", "--repeats", "2",
                             "--threads", "1", "--policy", policy, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["same_state"] is True
    assert set(result["ms_per_layer"]) == {"torch", "compiled"} and all(len(t) == 2 for t in
                                                                         result["ms_per_layer"].values())
    med = result["median_ms"]
    assert result["over_torch"]["compiled"] == pytest.approx(med["compiled"] / med["torch"])
    assert f"KV commit per layer ({policy}, 3 x 3 x 12 slots" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("switch", ["all", "layer-math"])
def test_decode_ab_times_both_attentions_from_one_prefill(kernel, tmp_path, monkeypatch, switch):
    """Each side is a Kernels set on the engine: the torch side runs torch's RMSNorm (and with --switch all, the
    torch decode attention too), the compiled side the kernels'; no environment variable is touched."""
    from flexgen_h2o.kernels import build, dispatch
    from flexgen_h2o.models import ops
    calls = {"torch norm": 0, "kernel norm": 0, "torch attention": 0}

    def counting(owner, name, key):
        real = getattr(owner, name)

        def call(*a, **kw):
            calls[key] += 1
            return real(*a, **kw)
        monkeypatch.setattr(owner, name, call)
    counting(ops, "rms_norm", "torch norm")
    counting(kernel.ext, "rms_norm_rows", "kernel norm")
    counting(ops, "narrow_decode_attention", "torch attention")
    assert decode_ab.main(["--batch", "2", "--prompt-len", "24", "--steps", "3", "--repeats", "2",
                           "--hh-size", "4", "--recent-size", "4", "--threads", "1", "--out", str(tmp_path),
                           "--switch", switch]) == 0
    assert calls["torch norm"] > 0 and calls["kernel norm"] > 0
    assert (calls["torch attention"] > 0) == (switch == "all")
    assert dispatch.LAYER_MATH_SWITCH not in os.environ and build.OFF_SWITCH not in os.environ
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["step_s"]) == {f"{c}-{s}" for c in ("h2o", "full") for s in ("torch", "compiled")}
    assert all(len(t) == 2 and all(x > 0 for x in t) for t in result["step_s"].values())
    assert set(result["torch_over_compiled"]) == {"h2o", "full"}


@pytest.mark.parametrize("bench", ["commit_cost", "linear_cost", "layer_math_cost"])
def test_a_kernel_benchmark_without_the_kernels_exits_2_with_one_line(bench, tmp_path, capsys, monkeypatch):
    from flexgen_h2o.kernels import build
    monkeypatch.setenv(build.OFF_SWITCH, "0")
    main = {"commit_cost": commit_cost.main, "linear_cost": linear_cost.main,
            "layer_math_cost": layer_math_cost.main}[bench]
    assert main(["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the compiled kernels are unavailable (switched off by")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_decode_ab_times_prompt_passes_with_phase_prefill(kernel, tmp_path):
    assert decode_ab.main(["--batch", "2", "--prompt-len", "24", "--repeats", "2", "--cases", "h2o", "--hh-size",
                           "4", "--recent-size", "4", "--threads", "1", "--out", str(tmp_path), "--switch",
                           "layer-math", "--phase", "prefill"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["step_s"]) == {"h2o-torch", "h2o-compiled"}
    assert all(len(t) == 2 and all(x > 0 for x in t) for t in result["step_s"].values())


def test_layer_math_cost_at_prompt_size_runs_the_kernel_on_the_threads_asked_for(kernel, tmp_path, capsys,
                                                                                 monkeypatch):
    """--tokens T: a prompt's rows (b, T, ...); the kernel cases run on --threads threads, not on one."""
    import torch
    seen = []
    real = kernel.ext.rope_rows
    monkeypatch.setattr(kernel.ext, "rope_rows",
                        lambda x, c, s: seen.append((tuple(x.shape), torch.get_num_threads())) or real(x, c, s))
    assert layer_math_cost.main(["--rows", "2", "--tokens", "5", "--calls", "1", "--repeats", "2", "--threads", "2",
                                 "--out", str(tmp_path)]) == 0
    assert seen and all(shape == (2, 9, 5, 64) and threads == 2 for shape, threads in seen)
    us = json.loads((tmp_path / "results.json").read_text())["median_us"]
    assert set(us["RoPE of q"]) == {"torch, 2 threads", "torch, 1 thread", "kernel"}
    assert "RoPE of q (2 rows x 5 tokens, median of 2): " in capsys.readouterr().out


def test_layer_math_cost_times_each_op_on_both_thread_counts_and_the_kernel(kernel, tmp_path):
    from flexgen_h2o.kernels import dispatch
    assert layer_math_cost.main(["--rows", "4", "--calls", "2", "--repeats", "2", "--out", str(tmp_path)]) == 0
    us = json.loads((tmp_path / "results.json").read_text())["median_us"]
    assert set(us) == {"RMSNorm", "silu(gate) * up", "RoPE of q", "cos/sin"}
    assert all(set(c) >= {"torch, 2 threads", "torch, 1 thread"} and all(t > 0 for t in c.values())
               for c in us.values())
    assert "kernel" in us["RMSNorm"] and "kernel" not in us["cos/sin"]
    assert dispatch.LAYER_MATH_SWITCH not in os.environ


@pytest.mark.slow
def test_decode_ab_base_times_another_build_of_the_kernels(kernel, tmp_path, monkeypatch):
    """--base REV: one side runs REV's build (here a stand-in that counts its linear calls), the other the
    working tree's."""
    from types import SimpleNamespace

    from flexgen_h2o.kernels import Kernels
    current = kernel.ext
    calls = []
    base = SimpleNamespace(**{name: getattr(current, name) for name in dir(current) if not name.startswith("_")})
    base.half_linear = lambda *a: calls.append(1) or current.half_linear(*a)
    monkeypatch.setattr(ab, "kernels_at", lambda rev: Kernels(base) if rev == "abc123" else pytest.fail(rev))
    assert decode_ab.main(["--batch", "2", "--prompt-len", "24", "--steps", "3", "--repeats", "2", "--cases", "h2o",
                           "--hh-size", "4", "--recent-size", "4", "--threads", "1", "--out", str(tmp_path),
                           "--base", "abc123"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["step_s"]) == {"h2o-kernels@abc123", "h2o-compiled"}
    assert set(result["kernels@abc123_over_compiled"]) == {"h2o"}
    # the base side's decode steps only (the shared prefill runs before either side): its warm-up's 2 and two
    # timed calls' 3, each step 30 layers x 7 projections + the LM head
    assert len(calls) == (2 + 2 * 3) * (30 * 7 + 1)


def test_kernels_at_builds_the_revisions_own_sources(tmp_path, monkeypatch):
    import subprocess
    from benchmarks.common import REPO_ROOT
    from flexgen_h2o.kernels import build
    built = {}
    monkeypatch.setattr(build, "jit_build", lambda sources, tag: built.update(sources=sources, tag=tag) or "module")
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert ab.kernels_at("HEAD").ext == "module" and built["tag"] == f"_{head}"  # the commit, not the moving name
    names = {p.name for p in built["sources"]}
    assert "bindings.cpp" in names and "half_linear.cpp" in names
    for path in built["sources"]:
        rel = build.CSRC.relative_to(REPO_ROOT) / path.name
        at_head = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=REPO_ROOT, capture_output=True, check=True)
        assert path.read_bytes() == at_head.stdout


def test_linear_cost_times_both_paths_and_the_fp32_blas_with_their_flop_rates(kernel, tmp_path, capsys):
    assert linear_cost.main(["--rows", "3", "--calls", "1", "--repeats", "2", "--threads", "1",
                             "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["ms_per_layer"]) == {"blas", "blas-fp32", "kernel", "peak-gemm"}
    assert all(len(t) == 2 and all(x > 0 for x in t) for t in result["ms_per_layer"].values())
    # SmolLM2's step: 30 layers of q, k, v, o, gate, up, down and the 49152 x 576 head, 2 FLOPs a weight a row
    per_row = 2 * (30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576) + 49152 * 576)
    assert result["flops_per_step"] == 3 * per_row
    rates = result["GFLOPs"]
    for case, ms in result["median_ms"].items():
        flops = 2 * 2048 ** 3 if case == "peak-gemm" else 3 * per_row
        assert rates[case] == pytest.approx(flops / (ms * 1e-3) / 1e9)
    # each linear case's time over the time its FLOPs take at the peak case's rate
    assert set(result["over_peak_bound"]) == {"blas", "blas-fp32", "kernel"}
    for case, ratio in result["over_peak_bound"].items():
        assert ratio == pytest.approx(result["median_ms"][case] / (3 * per_row / rates["peak-gemm"] / 1e6))
    # the three compute the same products: fp16 weights upcast exactly, so only the summation order differs
    assert 0 <= result["max_abs_difference"] < 1e-4
    assert "GFLOP/s: blas " in capsys.readouterr().out
