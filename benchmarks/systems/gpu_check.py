"""The one question the GPU-only peers (deepspeed, flexgen) ask first: is there a CUDA GPU here?"""
from __future__ import annotations

import importlib.util

NEEDS_GPU = "needs a CUDA GPU"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def gpu_skip_reason(package: str, install_hint: str) -> str | None:
    """None when the peer can run: a CUDA GPU and its package importable (looked up, not imported: importing
    deepspeed on a CPU machine compiles ops and prints warnings)."""
    if not cuda_available():
        return NEEDS_GPU
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed ({install_hint})"
    return None
