"""benchmarks/studies/prompt_attention.py: one tiny run times the three prompt-attention paths (no timing
asserted)."""
import json

import pytest

from benchmarks.studies.prompt_attention import CASES, main
from flexgen_h2o.kernels import build


def test_tiny_run_times_the_three_paths(tmp_path, capsys):
    if build.load() is None:
        pytest.skip(f"compiled prompt attention unavailable: {build.unavailable_reason()}")
    assert main(["--batch", "1", "--prompt-len", "40", "--repeats", "2", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    med = result["median_ms"]
    assert set(result["ms_per_layer"]) == set(CASES) and all(len(t) == 2 for t in result["ms_per_layer"].values())
    assert all(result["over_sdpa"][n] == pytest.approx(med[n] / med["sdpa"]) and med[n] > 0 for n in CASES)
    assert "prompt attention per layer" in capsys.readouterr().out


def test_base_times_another_build_of_the_kernel_and_puts_the_built_one_back(tmp_path, monkeypatch):
    """--base REV: one more case runs REV's build (here a stand-in that counts its calls and delegates)."""
    from types import SimpleNamespace

    from benchmarks.studies import ab
    from flexgen_h2o.kernels import Kernels
    built = build.load()
    if built is None:
        pytest.skip(f"compiled prompt attention unavailable: {build.unavailable_reason()}")
    calls = []
    other = SimpleNamespace(scored_prompt_attention=lambda *a: calls.append(1) or built.scored_prompt_attention(*a))
    monkeypatch.setattr(ab, "kernels_at", lambda rev: Kernels(other) if rev == "abc123" else None)
    assert main(["--batch", "1", "--prompt-len", "24", "--repeats", "2", "--threads", "1", "--base", "abc123",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["ms_per_layer"]) == {*CASES, "scored-kernel@abc123"}
    assert len(calls) == 3                              # the warm-up and two timed repeats
