"""The copy engine: round trips across every tier pair, byte counts, and errors that surface in the caller."""
from __future__ import annotations

import errno
import os
import threading
from concurrent.futures.thread import BrokenThreadPool

import pytest
import torch

from flexgen_h2o.backend import CPUBackend
from flexgen_h2o.memory import DiskFullError, DiskTier, MixedTier, Transfer

KINDS = ["compute", "host", "disk", "mixed"]
SRC_IDX = (slice(1, 7), slice(None), slice(2, 5))     # region (6, 3, 3)
DST_IDX = (slice(2, 8), slice(None), slice(0, 3))


def _deadline(fn, seconds: float = 20.0):
    """Run fn in a thread; fail (instead of hanging the suite) if it does not return in time."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test thread
            box["error"] = e
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"call did not return within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _home(tiers, kind, shape, dtype=torch.float16):
    if kind == "mixed":
        m = MixedTier([tiers["compute"], tiers["host"], tiers["disk"]], [0.3, 0.3, 0.4])
        return m.allocate(shape, dtype, name="m")
    return tiers[kind].allocate(shape, dtype, name=kind)


@pytest.mark.parametrize("dst_kind", KINDS)
@pytest.mark.parametrize("src_kind", KINDS)
def test_round_trip_pairs_sliced_with_fp16_to_fp32(tiers, transfer, src_kind, dst_kind):
    x = torch.randn(8, 3, 6)
    src = _home(tiers, src_kind, x.shape)
    transfer.copy(src, x, lane="kv_store")              # fp32 → fp16 storage
    transfer.wait("kv_store")
    dst = _home(tiers, dst_kind, (9, 3, 4), torch.float32)
    transfer.copy(dst, torch.zeros(9, 3, 4), lane="kv_load")    # memory tiers hand out uninitialised tensors
    transfer.copy(dst, src, dst_index=DST_IDX, src_index=SRC_IDX, lane="kv_load")
    transfer.wait("kv_load")
    out = torch.zeros(9, 3, 4)
    transfer.copy(out, dst, lane="hidden")
    transfer.synchronize()
    expected = torch.zeros(9, 3, 4)
    expected[DST_IDX] = x.half().float()[SRC_IDX]
    assert torch.equal(out, expected)


def test_chain_compute_host_disk_mixed_compute(tiers, transfer):
    x = torch.randn(10, 4)
    hops = [_home(tiers, k, x.shape) for k in ("compute", "host", "disk", "mixed", "compute")]
    transfer.copy(hops[0], x)
    for a, b in zip(hops, hops[1:]):
        transfer.copy(b, a, lane="weights")
        transfer.wait("weights")
    assert torch.equal(hops[-1].read(), x.half())


def test_bytes_moved_per_link(tiers, transfer):
    h = tiers["host"].from_tensor(torch.ones(4, 4, dtype=torch.float16))
    d = tiers["disk"].allocate((4, 4), torch.float16)
    c = tiers["compute"].allocate((2, 4), torch.float32)
    transfer.copy(d, h, lane="kv_store")
    transfer.copy(c, d, src_index=(slice(0, 2),), lane="kv_load")   # the read is 2 x 4 fp16 = 16 bytes
    transfer.synchronize()
    assert transfer.bytes_moved == {("host", "disk"): 32, ("disk", "compute"): 16}


def test_large_disk_copy_is_chunked_across_threads(tiers, backend, monkeypatch):
    x = torch.randn(16, 8).half()
    d = tiers["disk"].from_tensor(x)
    out = torch.empty(16, 8)
    threads = []
    piece = Transfer._disk_piece

    def spy(self, *args):
        threads.append(threading.current_thread().name)
        return piece(self, *args)
    monkeypatch.setattr(Transfer, "_disk_piece", spy)
    with Transfer(backend, chunk_bytes=64, io_threads=4) as tr:
        tr.copy(out, d, lane="weights").result(timeout_s=20)
        assert len(threads) == 4 and all(t.startswith("flexgen-io") for t in threads)
        row = torch.empty(8)
        tr.copy(row, d, src_index=(5,), lane="weights")     # int index: kept whole, on the lane's own thread
        tr.wait("weights")
    assert threads[-1].startswith("flexgen-weights")
    assert torch.equal(out, x.float()) and torch.equal(row, x[5].float())


def test_lane_is_fifo_across_disk_and_memory_copies(tiers, transfer):
    x = torch.randn(32, 16)
    d = tiers["disk"].from_tensor(x, dtype=torch.float16)
    for _ in range(5):
        h = tiers["host"].allocate((32, 16), torch.float16)
        h.payload.zero_()
        c = torch.zeros(32, 16)
        transfer.copy(d, torch.zeros(4, 16), dst_index=(slice(0, 4),), lane="kv_load")    # worker
        transfer.copy(h, d, lane="kv_load")                                               # worker, after it
        transfer.copy(c, h, lane="kv_load")        # inline copy, must queue behind the two disk jobs
        transfer.wait("kv_load")
        expected = x.half().float()
        expected[:4] = 0
        assert torch.equal(c, expected)
        transfer.copy(d, x[:4], dst_index=(slice(0, 4),), lane="kv_load")
        transfer.wait("kv_load")
        h.free()


def test_shape_mismatch_raises_in_caller(tiers, transfer):
    d = tiers["disk"].allocate((4, 4), torch.float16)
    with pytest.raises(ValueError, match="shape mismatch"):
        transfer.copy(d, torch.ones(3, 4))


def test_worker_error_surfaces_at_synchronize(tiers, transfer):
    d = tiers["disk"].allocate((64, 64), torch.float16)
    os.remove(d.payload.path)                      # the file vanishes under the copy engine
    transfer.copy(d, torch.ones(64, 64), lane="kv_store")
    with pytest.raises(FileNotFoundError) as ei:
        _deadline(lambda: transfer.synchronize(timeout_s=15))
    assert any("host -> disk" in n or "compute -> disk" in n for n in getattr(ei.value, "__notes__", []))
    transfer.synchronize()                         # the error was reported once; the engine is usable again


def test_worker_error_surfaces_at_wait_of_its_lane(tiers, transfer):
    d = tiers["disk"].allocate((8,), torch.float16)
    os.remove(d.payload.path)
    out = torch.empty(8)
    transfer.copy(out, d, lane="kv_load")
    transfer.wait("weights")                       # another lane is unaffected
    with pytest.raises(FileNotFoundError):
        _deadline(lambda: transfer.wait("kv_load", timeout_s=15))


def test_enospc_becomes_disk_full_error(tiers, transfer, monkeypatch):
    d = tiers["disk"].allocate((10, 100), torch.float16)

    def no_space(self, t, index, value, *, non_blocking=False):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(DiskTier, "write", no_space)
    transfer.copy(d, torch.ones(5, 100), dst_index=(slice(0, 5),), lane="kv_store")
    with pytest.raises(DiskFullError) as ei:
        _deadline(lambda: transfer.synchronize(timeout_s=15))
    assert str(ei.value) == f"disk full writing {d.payload.path}: needed 1000 bytes"
    assert ei.value.errno == errno.ENOSPC


class _NoDeviceBackend(CPUBackend):
    """A backend whose worker setup fails, like FlexGen's disk threads on a machine without CUDA (#115)."""

    def bind_thread(self) -> None:
        raise RuntimeError("no device for this worker")


def test_failed_worker_setup_surfaces_instead_of_hanging(tiers):
    d = tiers["disk"].allocate((4,), torch.float16)
    tr = Transfer(_NoDeviceBackend())

    def run():
        tr.copy(d, torch.ones(4), lane="kv_store")
        tr.synchronize(timeout_s=15)
    with pytest.raises(BrokenThreadPool):
        _deadline(run)


class _EventLog(CPUBackend):
    """The CPU backend, with record_event / wait_event logged: the protocol a CUDA stream relies on."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, object]] = []

    def record_event(self, lane):
        token = object()
        self.log.append(("record", lane, token))
        return token

    def wait_event(self, event):
        self.log.append(("wait", event))


def test_collect_makes_the_reader_wait_for_the_jobs_copies():
    """A lane job's future is done once its copies are enqueued; collect() must also order the reader's stream
    after them (without it a CUDA kernel read staged KV before it landed: the H100 abort of 2026-11-26)."""
    backend = _EventLog()
    transfer = Transfer(backend)
    try:
        fut = transfer.submit("kv", lambda: ("staged", backend.log.append(("job",))))
        assert _deadline(lambda: transfer.collect(fut))[0] == "staged"
        job, record, wait = backend.log
        assert job == ("job",) and record[:2] == ("record", "kv")
        assert wait == ("wait", record[2])            # the event recorded after this job, waited for by the reader
    finally:
        transfer.close()


def test_collect_returns_plain_values_on_a_backend_without_events(backend):
    transfer = Transfer(backend)
    try:
        assert transfer.collect(transfer.submit("weights", lambda: 7)) == 7
    finally:
        transfer.close()
