"""The hardware protocol: every device-specific call of the engine goes through a `Backend`.

Owns lanes (named copy streams), pinning, the compute dtype and device memory stats. Imports only torch and the
stdlib (level 0 of the import rules, `docs/architecture.md`). `cpu.py` implements it synchronously; `cuda.py` is
the only module of the package that touches the CUDA runtime (`docs/architecture.md`, level 0).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ContextManager

import torch
from torch import Tensor

# FlexGen's three copy streams plus the compute stream and a lane for activations, by name. Lanes are strings so
# that a caller can add one without touching this file; these are the ones the schedule uses.
LANES: tuple[str, ...] = ("compute", "weights", "kv_load", "kv_store", "hidden")


class Backend(ABC):
    """Everything hardware-specific, behind one small interface."""

    name: str                          # "cpu" or "cuda"
    is_cuda: bool
    compute_device: torch.device
    compute_dtype: torch.dtype         # fp32 on CPU (docs/architecture.md "Numerics"), fp16 on CUDA
    storage_dtype: torch.dtype = torch.float16   # weights and KV are stored fp16 on every tier

    @abstractmethod
    def pin(self, t: Tensor) -> Tensor:
        """Return `t` in page-locked memory (a copy if needed); identity on CPU."""

    @abstractmethod
    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Uninitialised host tensor, page-locked where the backend supports it."""

    @abstractmethod
    def lane(self, name: str) -> ContextManager[None]:
        """Context in which enqueued device work runs on lane `name` (a stream on CUDA, a no-op on CPU)."""

    @abstractmethod
    def record_event(self, lane: str) -> Any:
        """Mark the work enqueued on `lane` so far; returns an event (None on CPU)."""

    @abstractmethod
    def wait_event(self, event: Any) -> None:
        """Make the caller's current stream wait (device-side, no host block) for an event of record_event."""

    @abstractmethod
    def wait_lane(self, lane: str) -> None:
        """Make the caller's current stream wait (device-side, no host block) for work enqueued on `lane`."""

    @abstractmethod
    def synchronize(self, lane: str | None = None) -> None:
        """Block the host until `lane` (or, with None, the whole device) has finished its work."""

    @abstractmethod
    def device_memory(self) -> dict[str, int]:
        """{"current_bytes", "peak_bytes", "total_bytes"} of the compute device; zeros on CPU."""

    @abstractmethod
    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""

    def device_name(self) -> str | None:
        """The compute device's name (a GPU's model); None on a CPU."""
        return None

    def record_use(self, *tensors: object) -> None:
        """The work just enqueued on the current lane reads or writes these tensors: their device memory must
        not be handed to another stream before it completes (nothing to do on CPU; non-tensors are ignored)."""

    def bind_thread(self) -> None:
        """Prepare a worker thread to enqueue work for this backend (copy workers call it at start).

        Workers never pick a device themselves; FlexGen's disk threads did, and died silently on CPU-only hosts.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.compute_device}, compute_dtype={self.compute_dtype})"
