"""The copy lanes: a job's error surfaces in the caller, and collect() orders the reader after a job's copies."""
from __future__ import annotations

import threading
from concurrent.futures.thread import BrokenThreadPool

import pytest

from flexgen_h2o.backend import CPUBackend
from flexgen_h2o.memory import Transfer


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


def test_job_error_surfaces_at_synchronize(backend):
    transfer = Transfer(backend)

    def vanished():
        raise FileNotFoundError("the offload file vanished under the lane")
    try:
        transfer.submit("kv", vanished)
        with pytest.raises(FileNotFoundError):
            _deadline(transfer.synchronize)
        transfer.synchronize()                     # the error was reported once; the lanes are usable again
    finally:
        transfer.close()


class _NoDeviceBackend(CPUBackend):
    """A backend whose worker setup fails, like FlexGen's disk threads on a machine without CUDA (#115)."""

    def bind_thread(self) -> None:
        raise RuntimeError("no device for this worker")


def test_failed_worker_setup_surfaces_instead_of_hanging():
    tr = Transfer(_NoDeviceBackend())

    def run():
        tr.submit("kv", lambda: None)
        tr.synchronize()
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
