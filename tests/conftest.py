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
    """A kernels.Kernels holding the compiled build, every kernel on (the environment's switches aside): skipped
    where they cannot be built or are switched off, failed in CI, which must build them."""
    from flexgen_h2o.kernels import build, dispatch
    ext = build.load()
    if ext is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the compiled kernels: {build.unavailable_reason()}")
        pytest.skip(f"compiled kernels unavailable: {build.unavailable_reason()}")
    if os.environ.get(build.OFF_SWITCH, "1") == "0":
        pytest.skip(f"compiled kernels switched off ({build.OFF_SWITCH}=0)")
    return dispatch.Kernels(ext)
