"""Storage formats: how a tensor is held at rest on a tier (weights in the store, KV in a cache, bytes a link
carries), apart from the dtype it is computed in.

One small type knows its bytes and how to pack a compute tensor into its stored form and back. The weight store,
the KV cache, the planner and the tiers ask it instead of writing `numel * 2`, and `stage` is the one copy path
by which KV windows, weights and hidden states reach the compute device (a quantized format dequantizes there).
Today there are two plain formats, fp16 (the default for weights and KV) and fp32 (bit-faithful KV for tests);
the compression issue adds group-wise quantized ones, which pack into a byte tensor plus per-group scale and
minimum.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class StorageFormat:
    name: str                     # what the CLI, the plan and the report print: "fp16", "fp32"
    dtype: torch.dtype            # element type of the stored tensor

    @property
    def bits(self) -> int:
        return self.dtype.itemsize * 8

    @property
    def itemsize(self) -> int:
        """Bytes per stored element (a plain format: its dtype's)."""
        return self.dtype.itemsize

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype({torch.float16: "<f2", torch.float32: "<f4"}[self.dtype])

    def nbytes(self, numel: int) -> int:
        """Bytes `numel` values take in this format: what a tier holds and a link carries."""
        return int(numel) * self.itemsize

    def pack(self, x: Tensor) -> Tensor:
        """A compute tensor in its stored form (a cast for the plain formats)."""
        return x.to(self.dtype)

    def unpack(self, stored: Tensor, dtype: torch.dtype) -> Tensor:
        """The stored form back in a compute dtype."""
        return stored.to(dtype)

    def stage(self, stored: Tensor, device: torch.device, dtype: torch.dtype, into: Tensor | None = None,
              non_blocking: bool = False) -> Tensor:
        """The stored form on `device` in `dtype`, written into `into` (a reused buffer of its shape, on `device`
        in `dtype`) or into a fresh tensor; never the stored tensor itself."""
        if into is not None:
            return into.copy_(stored, non_blocking=non_blocking)
        return stored.to(device=device, dtype=dtype, copy=True, non_blocking=non_blocking)


FP16 = StorageFormat("fp16", torch.float16)
FP32 = StorageFormat("fp32", torch.float32)
FORMATS: dict[str, StorageFormat] = {f.name: f for f in (FP16, FP32)}
WEIGHT_FORMAT = FP16              # the converted store's format: weights are converted once, to fp16
# OffloadPolicy.kv_dtype's spellings (torch dtype names), kept for the API's users
_BY_DTYPE_NAME = {"float16": FP16, "float32": FP32}


def format_of(dtype: torch.dtype) -> StorageFormat:
    """The plain format that stores `dtype`."""
    return next(f for f in FORMATS.values() if f.dtype == dtype)


def storage_format(name: str) -> StorageFormat:
    """A format by its name ("fp16") or its torch dtype's name ("float16")."""
    found = FORMATS.get(name) or _BY_DTYPE_NAME.get(name)
    if found is None:
        raise ValueError(f"unknown storage format {name!r}; choose one of {', '.join(FORMATS)}")
    return found
