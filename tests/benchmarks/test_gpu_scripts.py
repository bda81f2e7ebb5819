"""The GPU scripts on a machine without CUDA: one error line naming what is missing, exit 2, nothing run."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the scripts would run")
@pytest.mark.parametrize("script", ["gpu_bench.sh", "gpu_check.sh"])
def test_gpu_script_refuses_without_cuda(script, tmp_path):
    r = subprocess.run(["bash", str(REPO / "scripts" / script), str(tmp_path / "out")], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "PY": sys.executable}, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: torch sees no CUDA GPU")
    assert not (tmp_path / "out").exists()
