"""Tensor handles: `TieredTensor` (shape, dtype, tier, payload; no math) and `MixedTensor` (one logical tensor
split along one dim into segments that live on different tiers), plus the basic-slicing helpers they share.

Payloads: a torch.Tensor (compute, host), a `DiskFile` (disk), a list of `Segment`s (mixed). FlexGen's
`TorchTensor` and `TorchMixedDevice` (ANCHORS.md §1.3). Imports only torch and the stdlib.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .tier import Tier

# Basic slicing only, as in FlexGen's general_copy: a slice, an int or a tuple of them (None = everything).
Index = Union[tuple[Any, ...], slice, int, None]


@dataclass(frozen=True)
class DiskFile:
    """Where a disk-tier tensor's bytes are: a `.npy` file whose data starts at `offset`."""
    path: str
    offset: int                  # bytes of .npy header before the data
    np_dtype: Any                # numpy dtype of the file (bf16 is stored as uint16 and viewed back)


@dataclass(eq=False)
class TieredTensor:
    """A handle on bytes that live on one tier. It owns no math; read and write go through its tier."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    tier: "Tier"
    payload: Any                 # Tensor | DiskFile | list[Segment]; None once freed
    name: str = ""
    pinned: bool = False         # page-locked host memory (only ever True on CUDA)

    @property
    def kind(self) -> str:
        return self.tier.kind

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def freed(self) -> bool:
        return self.payload is None

    def read(self, index: Index = None) -> Tensor:
        """Synchronous read of `self[index]` (a view for compute/host, a private memmap for disk)."""
        return self.tier.read(self, index)

    def write(self, index: Index, value: Tensor) -> None:
        """Synchronous `self[index] = value` (dtype converted)."""
        self.tier.write(self, index, value)

    def free(self) -> None:
        self.tier.free(self)

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return f"TieredTensor({self.name or '?'}, {tuple(self.shape)}, {self.dtype}, {self.tier.name}{state})"


@dataclass
class Segment:
    """Rows [start, stop) along the split dim of a mixed tensor, held by `tensor` on one tier."""
    start: int
    stop: int
    tensor: TieredTensor


@dataclass(eq=False, repr=False)
class MixedTensor(TieredTensor):
    """One logical tensor split along `dim` across tiers; for KV the split is by whole sequences (batch dim)."""
    dim: int = 0
    segments: list[Segment] = field(default_factory=list)

    def locate(self, index: Index) -> list[tuple[Segment, tuple[slice, ...], tuple[slice, ...]]]:
        """Split `self[index]` into per-segment pieces: (segment, index into the segment, index into the region).

        The region is the tensor `self[index]` would be; slices only (step 1), so every dim is kept.
        """
        idx = normalize_index(index, self.shape)
        want = idx[self.dim]
        pieces = []
        for seg in self.segments:
            lo, hi = max(want.start, seg.start), min(want.stop, seg.stop)
            if lo >= hi:
                continue
            seg_idx = replace_dim(idx, self.dim, slice(lo - seg.start, hi - seg.start))
            rel = tuple(slice(0, s.stop - s.start) for s in idx)
            pieces.append((seg, seg_idx, replace_dim(rel, self.dim, slice(lo - want.start, hi - want.start))))
        return pieces


# --- index helpers ---
def normalize_index(index: Index, shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Turn a basic index into one concrete `slice(start, stop)` per dim; ints and steps are refused."""
    if index is None:
        index = ()
    elif not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    if len(index) > len(shape):
        raise IndexError(f"index {index} has more dims than shape {tuple(shape)}")
    out = []
    for n, s in zip(shape, tuple(index) + (slice(None),) * (len(shape) - len(index))):
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise IndexError(f"only step-1 slices are supported here, got {s!r} (ints would drop a dim)")
        start, stop, _ = s.indices(n)
        out.append(slice(start, max(start, stop)))
    return tuple(out)


def compose_index(outer: tuple[slice, ...], inner: tuple[slice, ...]) -> tuple[slice, ...]:
    """Index into `x` equal to `x[outer][inner]`, for normalised outer and region-relative inner."""
    return tuple(slice(o.start + i.start, o.start + i.stop) for o, i in zip(outer, inner))


def replace_dim(index: tuple[slice, ...], dim: int, s: slice) -> tuple[slice, ...]:
    return index[:dim] + (s,) + index[dim + 1:]


def region_shape(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    """Shape of `x[index]` for any basic index, computed on the meta device (no data touched)."""
    if index is None:
        return tuple(shape)
    return tuple(torch.empty(shape, device="meta")[index].shape)


def split_sizes(n: int, fracs: list[float], granule: int = 1) -> list[int]:
    """Lengths of the parts of `n` rows split by `fracs`, each boundary rounded to a multiple of `granule`.

    Rounding the cumulative boundary (not each part) keeps the parts summing to `n`; the last part takes the
    remainder, so with granule = heads-per-sequence no sequence is ever cut in two (FlexGen's rule for KV).
    """
    if abs(sum(fracs) - 1.0) > 1e-6 or any(f < 0 for f in fracs):
        raise ValueError(f"split fractions must be >= 0 and sum to 1, got {fracs}")
    bounds, acc = [0], 0.0
    for f in fracs[:-1]:
        acc += f
        b = int(round(acc * n / granule)) * granule
        bounds.append(min(max(b, bounds[-1]), n))
    bounds.append(n)
    return [b - a for a, b in zip(bounds, bounds[1:])]
