"""Fixtures for memory/ tests: a CPU backend and the three tiers on a temp dir."""
from __future__ import annotations

import pytest

from flexgen_h2o.backend import CPUBackend
from flexgen_h2o.memory import ComputeTier, DiskTier, HostTier


@pytest.fixture
def backend():
    return CPUBackend()


@pytest.fixture
def tiers(backend, tmp_path):
    disk = DiskTier(tmp_path / "disk")
    yield {"compute": ComputeTier(backend, capacity_bytes=1 << 20), "host": HostTier(backend), "disk": disk}
    disk.close()
