"""Backend selection and the CPU backend's no-op protocol; a CUDA smoke test runs where a GPU exists."""
from __future__ import annotations

import pytest
import torch

from flexgen_h2o.backend import LANES, CPUBackend, CUDABackend, get_backend
from flexgen_h2o.memory import DiskTier, HostTier, ComputeTier, Transfer


def test_get_backend_cpu():
    b = get_backend("cpu")
    assert isinstance(b, CPUBackend) and not b.is_cuda
    assert b.compute_device == torch.device("cpu")
    assert b.compute_dtype == torch.float32 and b.storage_dtype == torch.float16
    with pytest.raises(ValueError, match="unknown device"):
        get_backend("tpu")


def test_get_backend_default_follows_availability():
    expected = CUDABackend if torch.cuda.is_available() else CPUBackend
    assert isinstance(get_backend(None), expected)


def test_cpu_protocol_is_noop():
    b = CPUBackend()
    x = torch.ones(3)
    assert b.pin(x) is x
    assert b.empty_pinned((2, 3), torch.float16).shape == (2, 3)
    for lane in LANES:
        with b.lane(lane):
            pass
        assert b.record_event(lane) is None
        b.wait_lane(lane)
        b.synchronize(lane)
    b.synchronize()
    assert b.device_memory() == {"current_bytes": 0, "peak_bytes": 0, "total_bytes": 0}


@pytest.mark.gpu
def test_cuda_backend_round_trip(tmp_path):
    b = get_backend("cuda")
    assert b.is_cuda and b.compute_dtype == torch.float16
    host, comp, disk = HostTier(b, pin=True), ComputeTier(b), DiskTier(tmp_path)
    x = torch.randn(6, 4, 8)
    h = host.allocate(x.shape, torch.float16)
    h.payload.copy_(x)
    assert h.pinned and h.payload.is_pinned()
    d = disk.allocate(x.shape, torch.float16)
    g = comp.allocate(x.shape, torch.float32)
    disk.torch_view(d).copy_(h.payload)
    tr = Transfer(b)
    try:        # the disk -> device copy on the kv lane's stream; collect orders this stream after it
        tr.collect(tr.submit("kv", lambda: g.payload.copy_(disk.torch_view(d))))
        back = host.allocate(x.shape, torch.float32, pinned=True)
        back.payload.copy_(g.payload)
    finally:
        tr.close()
    torch.testing.assert_close(back.payload, x.half().float())
    assert b.device_memory()["peak_bytes"] > 0
    disk.close()
