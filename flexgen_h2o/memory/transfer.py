"""The one copy primitive: `Transfer.copy(dst, src, dst_index, src_index, lane)` means dst[dst_index] = src[src_index].

FlexGen's `general_copy` (ANCHORS.md §1.3) with the dispatch written as a table keyed by (src kind, dst kind), so a
new pair is one entry. Copies between memory tiers are enqueued inline on the lane (a CUDA stream, or done at once on
CPU); anything touching disk runs on the lane's own worker thread, and large disk copies are split across a small
pool of I/O threads (memmap page faults and torch copies release the GIL). Like a CUDA stream, a lane is FIFO:
copies issued on one lane complete in issue order; different lanes run concurrently. Mixed tensors recurse into
their segments. Every worker error is stored in its future and re-raised in the caller at wait()/synchronize(), so
a failed copy can never hang the run or vanish (FlexGen #115). Workers get their device from the backend
(`Backend.bind_thread`) and never choose one themselves.
"""
from __future__ import annotations

import errno
import math
import threading
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torch import Tensor

from ..backend.base import Backend
from .tensor import Index, TieredTensor, compose_index, normalize_index, region_shape, replace_dim
from .tier import DiskFullError

# A copy endpoint: a tiered handle, or a plain tensor already on the compute device or in host memory.
Endpoint = Union[TieredTensor, Tensor]

_KINDS = ("compute", "host", "disk", "mixed")
# (src kind, dst kind) → how the copy runs. "inline": enqueue on the lane now; "worker": the lane's thread;
# "mixed": split into per-segment copies, each dispatched through this same table.
_ROUTES: dict[tuple[str, str], str] = {
    ("compute", "compute"): "inline", ("compute", "host"): "inline",
    ("host", "compute"): "inline", ("host", "host"): "inline",
    ("disk", "compute"): "worker", ("disk", "host"): "worker", ("disk", "disk"): "worker",
    ("compute", "disk"): "worker", ("host", "disk"): "worker",
    **{(k, "mixed"): "mixed" for k in _KINDS}, **{("mixed", k): "mixed" for k in _KINDS},
}


@dataclass(frozen=True)
class LaneResult:
    """A submitted job's value on a backend with streams, with the event recorded after the copies it enqueued."""
    value: Any
    event: Any


class TransferTimeoutError(TimeoutError):
    """Copies were still running when a wait's timeout expired."""


class CopyHandle:
    """What `copy` returns: the futures of the worker jobs it started (none for inline copies)."""

    def __init__(self, futures: list[Future] | None = None) -> None:
        self.futures = futures or []

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout_s: float | None = None) -> None:
        """Block until this copy's worker jobs finish; re-raise the first error.

        Host-side only: on CUDA, use Transfer.wait(lane) before reading what a device copy wrote."""
        _drain(self.futures, timeout_s, "this copy")


def _drain(futures: list[Future], timeout_s: float | None, what: str) -> None:
    _, not_done = wait_futures(futures, timeout=timeout_s)
    if not_done:
        raise TransferTimeoutError(f"{len(not_done)} copies on {what} still running after {timeout_s} s")
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        if len(errors) > 1:
            errors[0].add_note(f"({len(errors) - 1} more copy errors on {what})")
        raise errors[0]


def _read(x: Endpoint, index: Index) -> Tensor:
    if isinstance(x, Tensor):
        return x if index is None else x[index]
    if x.freed:
        raise RuntimeError(f"copy from freed {x!r}")
    return x.tier.read(x, index)


def _write(x: Endpoint, index: Index, value: Tensor, non_blocking: bool) -> None:
    if isinstance(x, Tensor):
        (x if index is None else x[index]).copy_(value, non_blocking=non_blocking)
        return
    if x.freed:
        raise RuntimeError(f"copy into freed {x!r}")
    x.tier.write(x, index, value, non_blocking=non_blocking)


def _payload(x: Endpoint) -> object:
    """The tensor behind an endpoint (a disk tier's payload is a file, which record_use ignores)."""
    return x if isinstance(x, Tensor) else x.payload


class Transfer:
    """Asynchronous copies between tiers, on named lanes, with per-link byte counts."""

    def __init__(self, backend: Backend, *, io_threads: int = 4, chunk_bytes: int = 64 << 20,
                 timeout_s: float | None = None) -> None:
        self.backend = backend
        self.io_threads = io_threads
        self.chunk_bytes = chunk_bytes        # disk copies above this are split across the I/O threads
        self.timeout_s = timeout_s            # default for wait/synchronize; None = wait as long as it takes
        self.bytes_moved: Counter[tuple[str, str]] = Counter()   # (src kind, dst kind) → bytes read from src
        self._pending: dict[str, list[Future]] = defaultdict(list)
        self._lanes: dict[str, ThreadPoolExecutor] = {}   # one thread per lane keeps each lane in issue order
        self._io: ThreadPoolExecutor | None = None        # shared by the lanes for the chunks of large copies
        self._lock = threading.Lock()
        self._dispatch: dict[tuple[str, str], Callable[..., CopyHandle]] = {
            pair: getattr(self, f"_copy_{route}") for pair, route in _ROUTES.items()}

    # --- public API ---
    def copy(self, dst: Endpoint, src: Endpoint, *, dst_index: Index = None, src_index: Index = None,
             lane: str = "compute") -> CopyHandle:
        """dst[dst_index] = src[src_index] on `lane`, dtype converted. Returns at once; wait(lane) to complete."""
        pair = (self.kind_of(src), self.kind_of(dst))
        route = self._dispatch.get(pair)
        if route is None:
            raise TypeError(f"no copy route from {pair[0]} to {pair[1]}")
        return route(dst, src, dst_index, src_index, lane)

    def submit(self, lane: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on `lane`'s worker after the lane's earlier jobs; errors surface at wait/synchronize.
        Read its value with collect(): the future is done once the copies are enqueued, not finished."""
        with self._lock:
            ex = self._lanes.get(lane)
            if ex is None:
                ex = self._lanes[lane] = self._executor(1, f"flexgen-{lane}")
            fut = ex.submit(self._run, lane, fn, args)
            pending = self._pending[lane]
            # drop finished successes now: a future holds its result (e.g. a staged layer's weights), so
            # keeping them until the next wait would keep every staged tensor alive; failures stay to be raised
            pending[:] = [f for f in pending if not f.done() or f.exception() is not None]
            pending.append(fut)
        return fut

    def collect(self, fut: Future) -> Any:
        """A submitted job's value, safe to read on the caller's stream: waits for the job on the host, then makes
        the caller's stream wait (on the device) for the copies the job enqueued on its lane. Without the second
        wait a CUDA kernel could read staged weights or KV before their copy landed: an H100 under 8 test
        processes read out-of-range slot indices that way (2026-11-26)."""
        value = fut.result()
        if isinstance(value, LaneResult):
            self.backend.wait_event(value.event)
            return value.value
        return value

    def _executor(self, n: int, prefix: str) -> ThreadPoolExecutor:
        # Workers get their device from the backend; a failing setup breaks the pool, which every later
        # submit and every pending future reports (BrokenThreadPool) instead of hanging.
        return ThreadPoolExecutor(n, thread_name_prefix=prefix, initializer=self.backend.bind_thread)

    def _busy(self, lane: str) -> bool:
        with self._lock:
            return any(not f.done() for f in self._pending.get(lane, ()))

    def wait(self, lane: str, timeout_s: float | None = None) -> None:
        """Block until every copy issued on `lane` has finished; re-raise the first worker error."""
        with self._lock:
            futures = self._pending.pop(lane, [])
        _drain(futures, timeout_s if timeout_s is not None else self.timeout_s, f"lane {lane!r}")
        self.backend.synchronize(lane)

    def synchronize(self, timeout_s: float | None = None) -> None:
        """Block until every lane is idle; re-raise the first worker error of any lane."""
        with self._lock:
            futures = [f for fs in self._pending.values() for f in fs]
            self._pending.clear()
        _drain(futures, timeout_s if timeout_s is not None else self.timeout_s, "all lanes")
        self.backend.synchronize()

    def close(self) -> None:
        """Finish outstanding copies (raising their errors) and stop the worker threads."""
        try:
            self.synchronize()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            pools = list(self._lanes.values()) + ([self._io] if self._io else [])
            self._lanes, self._io = {}, None
            self._pending.clear()
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:                  # already unwinding: stop the threads, do not mask the original error
            self._shutdown()

    def kind_of(self, x: Endpoint) -> str:
        if isinstance(x, Tensor):
            return "compute" if x.device.type == self.backend.compute_device.type else "host"
        return x.kind

    # --- routes ---
    def _account(self, dst: Endpoint, src: Endpoint, di: Index, si: Index) -> tuple[int, ...]:
        """Check shapes in the caller (a mismatch must not surface later from a thread) and count the bytes."""
        src_shape = region_shape(tuple(src.shape), si)
        dst_shape = region_shape(tuple(dst.shape), di)
        try:
            ok = torch.broadcast_shapes(src_shape, dst_shape) == torch.Size(dst_shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"copy shape mismatch: src region {src_shape} into dst region {dst_shape}")
        nbytes = math.prod(src_shape) * src.dtype.itemsize
        with self._lock:
            self.bytes_moved[(self.kind_of(src), self.kind_of(dst))] += nbytes
        return dst_shape

    def _copy_inline(self, dst: Endpoint, src: Endpoint, di: Index, si: Index, lane: str) -> CopyHandle:
        self._account(dst, src, di, si)
        if self._busy(lane):       # keep the lane FIFO: queue behind its pending disk copies
            return CopyHandle([self.submit(lane, self._inline_job, dst, src, di, si)])
        with self.backend.lane(lane):
            self._inline_job(dst, src, di, si)
        return CopyHandle()

    def _inline_job(self, dst: Endpoint, src: Endpoint, di: Index, si: Index) -> None:
        value = _read(src, si)
        _write(dst, di, value, non_blocking=self.backend.is_cuda)
        self.backend.record_use(value, _payload(dst))

    def _copy_worker(self, dst: Endpoint, src: Endpoint, di: Index, si: Index, lane: str) -> CopyHandle:
        shape = self._account(dst, src, di, si)
        pieces = self._chunks(dst, src, di, si, shape, math.prod(shape) * dst.dtype.itemsize)
        return CopyHandle([self.submit(lane, self._disk_job, dst, src, pieces, lane)])

    def _disk_job(self, dst: Endpoint, src: Endpoint, pieces: list[tuple[Index, Index]], lane: str) -> None:
        """Runs on the lane's thread; fans a large copy out to the I/O pool and waits, so the lane stays FIFO."""
        if len(pieces) == 1:
            self._disk_piece(dst, src, *pieces[0], lane)
            return
        with self._lock:
            if self._io is None:
                self._io = self._executor(self.io_threads, "flexgen-io")
            io = self._io
        _drain([io.submit(self._run, lane, self._disk_piece, (dst, src, d, s, lane)) for d, s in pieces],
               None, f"lane {lane!r} chunks")

    def _chunks(self, dst: Endpoint, src: Endpoint, di: Index, si: Index, shape: tuple[int, ...],
                nbytes: int) -> list[tuple[Index, Index]]:
        """Split a large disk copy along its first dim so the I/O threads read it in parallel."""
        n = min(self.io_threads, -(-nbytes // max(self.chunk_bytes, 1)), shape[0] if shape else 1)
        if n <= 1:
            return [(di, si)]
        try:
            dn, sn = normalize_index(di, tuple(dst.shape)), normalize_index(si, tuple(src.shape))
        except IndexError:        # ints in an index: keep it whole
            return [(di, si)]
        if region_shape(tuple(src.shape), sn) != shape:    # broadcast copy: keep it whole
            return [(di, si)]
        full = tuple(slice(0, s) for s in shape)
        step = -(-shape[0] // n)
        rows = [slice(a, min(a + step, shape[0])) for a in range(0, shape[0], step)]
        return [(compose_index(dn, replace_dim(full, 0, r)), compose_index(sn, replace_dim(full, 0, r)))
                for r in rows]

    def _disk_piece(self, dst: Endpoint, src: Endpoint, di: Index, si: Index, lane: str) -> None:
        try:
            _write(dst, di, _read(src, si), non_blocking=False)     # synchronous: nothing is left queued
        except Exception as e:
            if isinstance(e, OSError) and e.errno == errno.ENOSPC and not isinstance(e, DiskFullError):
                path = getattr(getattr(dst, "payload", None), "path", "?")
                nbytes = math.prod(region_shape(tuple(dst.shape), di)) * dst.dtype.itemsize
                raise DiskFullError(path, nbytes) from e
            e.add_note(f"while copying {self.kind_of(src)} -> {self.kind_of(dst)} on lane {lane!r}")
            raise

    def _copy_mixed(self, dst: Endpoint, src: Endpoint, di: Index, si: Index, lane: str) -> CopyHandle:
        dn, sn = normalize_index(di, tuple(dst.shape)), normalize_index(si, tuple(src.shape))
        if region_shape(tuple(dst.shape), dn) != region_shape(tuple(src.shape), sn):
            raise ValueError(f"mixed copy needs equal regions: {dst!r}[{dn}] vs {src!r}[{sn}]")
        handles = []
        if self.kind_of(src) == "mixed":
            for seg, seg_idx, rel in src.locate(sn):
                handles.append(self.copy(dst, seg.tensor, dst_index=compose_index(dn, rel), src_index=seg_idx,
                                         lane=lane))
        else:
            for seg, seg_idx, rel in dst.locate(dn):
                handles.append(self.copy(seg.tensor, src, dst_index=seg_idx, src_index=compose_index(sn, rel),
                                         lane=lane))
        return CopyHandle([f for h in handles for f in h.futures])

    def _run(self, lane: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        with self.backend.lane(lane):
            value = fn(*args)
            event = self.backend.record_event(lane)
        return value if event is None else LaneResult(value, event)
