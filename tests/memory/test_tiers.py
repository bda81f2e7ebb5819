"""Tiers: exact byte accounting, capacity errors, real disk files."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from flexgen_h2o.memory import ComputeTier, DiskFullError, DiskTier, HostTier, TierFullError
from flexgen_h2o.memory import tier as tier_mod


@pytest.mark.parametrize("kind", ["compute", "host", "disk"])
def test_accounting_current_and_peak_exact(tiers, kind):
    t = tiers[kind]
    a = t.allocate((3, 5), torch.float16)     # 30 bytes
    b = t.allocate((2, 2), torch.float32)     # 16 bytes
    assert (t.current_bytes, t.peak_bytes) == (46, 46)
    a.free()
    assert (t.current_bytes, t.peak_bytes) == (16, 46)
    c = t.allocate((25,), torch.float32)      # 100 bytes
    assert (t.current_bytes, t.peak_bytes) == (116, 116)
    b.free()
    c.free()
    assert t.current_bytes == 0
    with pytest.raises(RuntimeError, match="double free"):
        c.free()
    t.reset_peak()
    assert t.peak_bytes == 0


def test_compute_capacity_error(backend):
    t = ComputeTier(backend, capacity_bytes=1000)
    a = t.allocate((300,), torch.float16)     # 600 bytes
    with pytest.raises(TierFullError) as ei:
        t.allocate((150,), torch.float32)     # 600 more: 400 free
    err = ei.value
    assert isinstance(err, MemoryError)
    assert (err.asked_bytes, err.free_bytes, err.tier_name) == (600, 400, "compute")
    assert "compute" in str(err) and "600 bytes" in str(err) and "400 bytes free" in str(err)
    assert t.current_bytes == 600            # a refused allocation leaves the books untouched
    a.free()
    t.allocate((150,), torch.float32)


def test_host_pin_ignored_on_cpu(backend):
    t = HostTier(backend, pin=True).allocate((4,), torch.float16)
    assert not t.pinned                      # no device to pin for


def test_disk_file_real_size_and_deleted_on_free(tmp_path):
    disk = DiskTier(tmp_path)
    t = disk.allocate((7, 33), torch.float16, name="layers.0/k")
    path = t.payload.path
    assert os.path.dirname(path) == str(tmp_path) and path.endswith(".npy")
    assert os.path.getsize(path) == t.payload.offset + 7 * 33 * 2
    assert os.stat(path).st_blocks * 512 >= 7 * 33 * 2      # blocks reserved up front, not a sparse file
    x = torch.randn(7, 33)
    disk.torch_view(t).copy_(x)                              # fp32 value stored as fp16
    np.testing.assert_array_equal(np.load(path), x.half().numpy())
    t.free()
    assert not os.path.exists(path) and disk.current_bytes == 0


def test_disk_shared_view_and_close(tmp_path):
    disk = DiskTier(tmp_path)
    t = disk.allocate((4,), torch.float32)
    disk.torch_view(t)[1] = 7.0               # shared mapping: lands in the file
    assert np.load(t.payload.path)[1] == 7.0
    disk.close()
    assert os.listdir(tmp_path) == []


def test_disk_bfloat16(tmp_path):
    disk = DiskTier(tmp_path / "d")
    x = torch.randn(3, 4).bfloat16()
    t = disk.allocate(x.shape, torch.bfloat16)
    disk.torch_view(t).copy_(x)
    assert torch.equal(disk.torch_view(t), x)    # a fresh mapping reads back what the file holds


def test_disk_enospc_at_allocation(tmp_path, monkeypatch):
    def full(path, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tier_mod, "_fallocate", full)
    disk = DiskTier(tmp_path)
    with pytest.raises(DiskFullError, match=r"disk full writing .*\.npy: needed 4000 bytes"):
        disk.allocate((1000,), torch.float32)
    assert os.listdir(tmp_path) == [] and disk.current_bytes == 0 and disk.peak_bytes == 0


def test_real_oom_maps_to_tier_full_and_restores_books(backend):
    host = HostTier(backend)
    with pytest.raises(TierFullError, match="host tier 'host' is full"):
        host.allocate((1 << 50,), torch.float32)          # 4 PiB: the allocator itself refuses
    assert host.current_bytes == 0 and host.peak_bytes == 0
