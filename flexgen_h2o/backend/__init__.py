"""Backends: `get_backend()` picks CUDA when asked for (or available), else the synchronous CPU backend."""
from __future__ import annotations

import torch

from .base import LANES, Backend
from .cpu import CPUBackend
from .cuda import CUDABackend, is_available as cuda_is_available, rank_device

__all__ = ["LANES", "Backend", "CPUBackend", "CUDABackend", "get_backend", "rank_device", "cuda_is_available"]


def get_backend(device: str | torch.device | None = None, compute_dtype: torch.dtype | None = None) -> Backend:
    """"cuda", "cuda:N" → CUDABackend; "cpu" → CPUBackend; None → CUDA if a GPU is visible, else CPU.
    compute_dtype overrides CUDA's fp16 (fp32 on a GPU lets tests hold it to the CPU's references); the CPU
    always computes in fp32."""
    if device is None:
        device = "cuda" if cuda_is_available() else "cpu"
    dev = str(device)
    if dev.startswith("cuda"):
        return CUDABackend(dev, compute_dtype or torch.float16)
    if dev == "cpu":
        return CPUBackend()
    raise ValueError(f"unknown device {device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
