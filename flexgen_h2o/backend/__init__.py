"""Backends: `get_backend()` picks CUDA when asked for (or available), else the synchronous CPU backend."""
from __future__ import annotations

import torch

from .base import LANES, Backend
from .cpu import CPUBackend
from .cuda import CUDABackend, is_available as cuda_is_available

__all__ = ["LANES", "Backend", "CPUBackend", "CUDABackend", "get_backend"]


def get_backend(device: str | torch.device | None = None) -> Backend:
    """"cuda", "cuda:N" → CUDABackend; "cpu" → CPUBackend; None → CUDA if a GPU is visible, else CPU."""
    if device is None:
        return CUDABackend() if cuda_is_available() else CPUBackend()
    dev = str(device)
    if dev.startswith("cuda"):
        return CUDABackend(dev)
    if dev == "cpu":
        return CPUBackend()
    raise ValueError(f"unknown device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
