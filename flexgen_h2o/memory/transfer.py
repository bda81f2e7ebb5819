"""Copy lanes: named workers that run the executor's staging jobs (weights, KV) beside compute.

`submit(lane, fn, *args)` runs `fn` on the lane's own thread, inside the backend's stream for that lane. Like a
CUDA stream, a lane is FIFO: jobs submitted to one lane complete in issue order; different lanes run concurrently.
Every job's error is stored in its future and re-raised in the caller at collect()/synchronize(), so a failed copy
can never hang the run or vanish (FlexGen #115). Workers get their device from the backend (`Backend.bind_thread`)
and never choose one themselves.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from ..backend.base import Backend


@dataclass(frozen=True)
class LaneResult:
    """A submitted job's value on a backend with streams, with the event recorded after the copies it enqueued."""
    value: Any
    event: Any


def _drain(futures: list[Future], what: str) -> None:
    """Wait for every future; re-raise the first error (the others are counted in a note, not lost silently)."""
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        if len(errors) > 1:
            errors[0].add_note(f"({len(errors) - 1} more copy errors on {what})")
        raise errors[0]


class Transfer:
    """Named FIFO lanes, one worker thread each, started on first use."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._pending: dict[str, list[Future]] = defaultdict(list)
        self._lanes: dict[str, ThreadPoolExecutor] = {}   # one thread per lane keeps each lane in issue order
        self._lock = threading.Lock()

    def submit(self, lane: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on `lane`'s worker after the lane's earlier jobs; errors surface at synchronize.
        Read its value with collect(): the future is done once the copies are enqueued, not finished."""
        with self._lock:
            ex = self._lanes.get(lane)
            if ex is None:
                # A failing bind_thread breaks the pool, which every later submit and every pending future
                # reports (BrokenThreadPool) instead of hanging.
                ex = self._lanes[lane] = ThreadPoolExecutor(1, thread_name_prefix=f"flexgen-{lane}",
                                                            initializer=self.backend.bind_thread)
            fut = ex.submit(self._run, lane, fn, args)
            pending = self._pending[lane]
            # drop finished successes now: a future holds its result (e.g. a staged layer's weights), so
            # keeping them until the next synchronize would keep every staged tensor alive; failures stay
            pending[:] = [f for f in pending if not f.done() or f.exception() is not None]
            pending.append(fut)
        return fut

    def collect(self, fut: Future) -> Any:
        """A submitted job's value, safe to read on the caller's stream: waits for the job on the host, then makes
        the caller's stream wait (on the device) for the copies the job enqueued on its lane. Without the second
        wait a CUDA kernel could read staged weights or KV before their copy landed (`docs/architecture.md`
        "Copy lanes"; `tests/test_cuda.py::test_a_staged_tensor_is_read_after_its_copy_lands`)."""
        value = fut.result()
        if isinstance(value, LaneResult):
            self.backend.wait_event(value.event)
            return value.value
        return value

    def synchronize(self) -> None:
        """Block until every lane is idle; re-raise the first job error of any lane."""
        with self._lock:
            futures = [f for fs in self._pending.values() for f in fs]
            self._pending.clear()
        _drain(futures, "all lanes")
        self.backend.synchronize()

    def close(self) -> None:
        """Finish outstanding jobs (raising their errors) and stop the worker threads."""
        try:
            self.synchronize()
        finally:
            with self._lock:
                pools, self._lanes = list(self._lanes.values()), {}
                self._pending.clear()
            for pool in pools:
                pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, lane: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        with self.backend.lane(lane):
            value = fn(*args)
            event = self.backend.record_event(lane)
        return value if event is None else LaneResult(value, event)
