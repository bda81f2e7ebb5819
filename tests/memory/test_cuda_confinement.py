"""Static check: backend/cuda.py is the only file of the package that mentions torch's CUDA module."""
from __future__ import annotations

import re
from pathlib import Path

import flexgen_h2o

PKG = Path(flexgen_h2o.__file__).parent
PATTERN = re.compile(r"torch\.cuda|from\s+torch\s+import\s+[^\n]*\bcuda\b")


def test_torch_cuda_only_in_backend_cuda():
    offenders = [str(p.relative_to(PKG)) for p in sorted(PKG.rglob("*.py"))
                 if p.relative_to(PKG).as_posix() != "backend/cuda.py" and PATTERN.search(p.read_text())]
    assert offenders == []
    assert PATTERN.search((PKG / "backend" / "cuda.py").read_text())
