"""CUDA backend: one stream per named lane, events, pinned host memory and device memory stats.

This is the only module of flexgen_h2o that may touch `torch.cuda` (tests/memory/test_layering greps for it).
Mirrors FlexGen's three copy streams, but named and created lazily (`docs/architecture.md` "Copy lanes").
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor

from .base import Backend


def is_available() -> bool:
    """True when torch was built with CUDA and a device is visible."""
    return torch.cuda.is_available()


def rank_device(local_rank: int) -> str:
    """The GPU of the local_rank-th rank on a node (round robin over the visible ones), made current: NCCL's
    sends and receives run on the current device."""
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


class CUDABackend(Backend):
    name = "cuda"
    is_cuda = True

    def __init__(self, device: str | torch.device = "cuda", compute_dtype: torch.dtype = torch.float16) -> None:
        dev = torch.device(device)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.compute_device = dev
        self.compute_dtype = compute_dtype
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._lock = threading.Lock()   # lanes are created from copy workers as well as the main thread

    # --- lanes ---
    def _stream(self, lane: str) -> torch.cuda.Stream:
        if lane == "compute":
            return torch.cuda.current_stream(self.compute_device)
        with self._lock:
            s = self._streams.get(lane)
            if s is None:
                s = self._streams[lane] = torch.cuda.Stream(device=self.compute_device)
            return s

    @contextmanager
    def lane(self, name: str) -> Iterator[None]:
        if name == "compute":
            with torch.cuda.device(self.compute_device):
                yield
            return
        stream = self._stream(name)
        # A copy may read what compute produced just before it was issued (KV store after attention), so the lane
        # first waits for the work already enqueued on the compute stream. It costs at most one step of overlap.
        stream.wait_stream(torch.cuda.current_stream(self.compute_device))
        with torch.cuda.device(self.compute_device), torch.cuda.stream(stream):
            yield

    def record_event(self, lane: str) -> Any:
        ev = torch.cuda.Event()
        ev.record(self._stream(lane))
        return ev

    def wait_event(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.compute_device).wait_event(event)

    def wait_lane(self, lane: str) -> None:
        torch.cuda.current_stream(self.compute_device).wait_stream(self._stream(lane))

    def synchronize(self, lane: str | None = None) -> None:
        if lane is None or lane == "compute":
            torch.cuda.synchronize(self.compute_device)
        else:
            self._stream(lane).synchronize()

    def record_use(self, *tensors: object) -> None:
        # A copy lane's source or destination may be dropped by the compute side while the copy is still queued;
        # without this the caching allocator could give its block to the compute stream's next kernel.
        for t in tensors:
            if isinstance(t, Tensor) and t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))

    # --- memory ---
    def pin(self, t: Tensor) -> Tensor:
        return t if t.is_pinned() else t.pin_memory()

    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def device_memory(self) -> dict[str, int]:
        return {
            "current_bytes": int(torch.cuda.memory_allocated(self.compute_device)),
            "peak_bytes": int(torch.cuda.max_memory_allocated(self.compute_device)),
            "total_bytes": int(torch.cuda.get_device_properties(self.compute_device).total_memory),
        }

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.compute_device)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.compute_device)

    def bind_thread(self) -> None:
        # The current device is per thread; copy workers get it from here, never choose one themselves.
        torch.cuda.set_device(self.compute_device)
