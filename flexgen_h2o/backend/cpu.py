"""CPU backend: synchronous lanes, no pinning, fp32 compute.

Everything is already ordered on the host, so lanes and events are no-ops; the engine still calls them, so the
same schedule code runs here and on CUDA.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from torch import Tensor

from .base import Backend


class CPUBackend(Backend):
    name = "cpu"
    is_cuda = False

    def __init__(self, compute_dtype: torch.dtype = torch.float32) -> None:
        self.compute_device = torch.device("cpu")
        # fp32 by default: fp16 matmul on CPU runs through slow scalar paths (docs/architecture.md "Numerics").
        self.compute_dtype = compute_dtype

    def pin(self, t: Tensor) -> Tensor:
        return t

    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype)

    def lane(self, name: str) -> ContextManager[None]:
        return nullcontext()

    def record_event(self, lane: str) -> Any:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def wait_lane(self, lane: str) -> None:
        return None

    def synchronize(self, lane: str | None = None) -> None:
        return None

    def device_memory(self) -> dict[str, int]:
        # No device: the compute tier's own accounting (memory.ComputeTier) is the CPU-side figure.
        return {"current_bytes": 0, "peak_bytes": 0, "total_bytes": 0}

    def reset_peak_memory(self) -> None:
        return None
