"""benchmarks/prompt_attention.py: one tiny run times the three prompt-attention paths (no timing asserted)."""
import json

import pytest

from benchmarks.prompt_attention import CASES, main
from flexgen_h2o.models import fused


def test_tiny_run_times_the_three_paths(tmp_path, capsys):
    if fused.module() is None:
        pytest.skip(f"compiled prompt attention unavailable: {fused.unavailable_reason()}")
    assert main(["--batch", "1", "--prompt-len", "40", "--repeats", "2", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    med = result["median_ms"]
    assert set(result["ms_per_layer"]) == set(CASES) and all(len(t) == 2 for t in result["ms_per_layer"].values())
    assert all(result["over_sdpa"][n] == pytest.approx(med[n] / med["sdpa"]) and med[n] > 0 for n in CASES)
    assert "prompt attention per layer" in capsys.readouterr().out
