"""`TieredTensor`: a handle on bytes a tier handed out (shape, dtype, tier, payload; no math).

Payloads: a torch.Tensor (compute, host) or a `DiskFile` (disk). FlexGen's `TorchTensor`.
Imports only torch and the stdlib.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .tier import Tier


@dataclass(frozen=True)
class DiskFile:
    """Where a disk-tier tensor's bytes are: a `.npy` file whose data starts at `offset`."""
    path: str
    offset: int                  # bytes of .npy header before the data
    np_dtype: Any                # numpy dtype of the file (bf16 is stored as uint16 and viewed back)


@dataclass(eq=False)
class TieredTensor:
    """A handle on bytes that live on one tier; free() gives them back and uncharges the tier."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    tier: "Tier"
    payload: Any                 # Tensor | DiskFile | tier.RESERVED; None once freed
    name: str = ""
    pinned: bool = False         # page-locked host memory (only ever True on CUDA)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def freed(self) -> bool:
        return self.payload is None

    def free(self) -> None:
        self.tier.free(self)

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return f"TieredTensor({self.name or '?'}, {tuple(self.shape)}, {self.dtype}, {self.tier.name}{state})"
