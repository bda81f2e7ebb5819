"""Shared fixtures: the compiled kernels (`kernel`), and the `slow` and `gpu` markers."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real SmolLM2 weights or long runs")
    config.addinivalue_line("markers", "gpu: needs CUDA")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kernel():
    """models.fused with its compiled kernels built: skipped where they cannot be, failed in CI, which must."""
    from flexgen_h2o.models import fused
    if fused.module() is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the compiled attention kernels: {fused.unavailable_reason()}")
        pytest.skip(f"compiled attention kernels unavailable: {fused.unavailable_reason() or 'switched off'}")
    return fused
