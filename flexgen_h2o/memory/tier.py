"""Tiers: where a TieredTensor's bytes live, and the engine's own byte accounting for each place.

ComputeTier (the GPU on CUDA; a budgeted host pool on CPU, so placements like `--percent 20 80` mean the same
thing everywhere), HostTier (CPU RAM, optionally pinned), DiskTier (one real `.npy` file per tensor) and
MixedTier (one logical tensor split along a dim across the others). FlexGen's TorchDevice / TorchDisk /
TorchMixedDevice (ANCHORS.md §1.3). Every tier counts `current_bytes` and `peak_bytes` of what it handed out.
"""
from __future__ import annotations

import errno
import itertools
import os
import re
import threading
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np
import psutil
import torch
from torch import Tensor

from ..backend.base import Backend
from .tensor import DiskFile, Index, MixedTensor, Segment, TieredTensor, region_shape, split_sizes


RESERVED = "reserved"       # payload of a reserve() handle: accounted bytes with nothing behind them


class TierFullError(MemoryError):
    """An allocation would exceed a tier's capacity."""

    def __init__(self, tier: "Tier", asked_bytes: int, free_bytes: int) -> None:
        self.tier_name, self.asked_bytes, self.free_bytes = tier.name, asked_bytes, free_bytes
        super().__init__(
            f"{tier.kind} tier '{tier.name}' is full: asked for {asked_bytes} bytes, {free_bytes} bytes free "
            f"(capacity {tier.capacity_bytes}, {tier.current_bytes} in use)")


class DiskFullError(OSError):
    """ENOSPC while creating or writing an offload file, with the file and the size that did not fit."""

    def __init__(self, path: str, needed_bytes: int) -> None:
        super().__init__(errno.ENOSPC, f"disk full writing {path}: needed {needed_bytes} bytes")
        self.filename, self.needed_bytes = path, needed_bytes

    def __str__(self) -> str:
        return self.strerror


class Tier:
    """Base: allocation bookkeeping shared by every tier. Subclasses provide allocate/free/read/write."""
    kind: ClassVar[str] = "?"

    def __init__(self, name: str, capacity_bytes: int | None = None) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.current_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()    # tensors may be allocated or freed from copy workers

    @property
    def free_bytes(self) -> int | None:
        return None if self.capacity_bytes is None else self.capacity_bytes - self.current_bytes

    def _charge(self, nbytes: int) -> None:
        with self._lock:
            if self.capacity_bytes is not None and self.current_bytes + nbytes > self.capacity_bytes:
                raise TierFullError(self, nbytes, self.capacity_bytes - self.current_bytes)
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _refund(self, nbytes: int, old_peak: int) -> None:
        """Undo a charge whose allocation failed; a failed allocation must not show up in the peak either."""
        with self._lock:
            self.current_bytes -= nbytes
            self.peak_bytes = old_peak

    def _release(self, t: TieredTensor) -> None:
        if t.freed:
            raise RuntimeError(f"double free of {t!r}")
        with self._lock:
            self.current_bytes -= t.nbytes
        t.payload = None

    def reserve(self, nbytes: int, name: str = "") -> TieredTensor:
        """Charge bytes that are allocated elsewhere (transient compute workspace): counted here, held by no
        payload; free() the handle to uncharge."""
        handle = TieredTensor((int(nbytes),), torch.uint8, self, RESERVED, name)
        self._charge(handle.nbytes)
        return handle

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def stats(self) -> dict[str, int | None]:
        return {"current_bytes": self.current_bytes, "peak_bytes": self.peak_bytes,
                "capacity_bytes": self.capacity_bytes}

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, *, pinned: bool | None = None,
                 name: str = "") -> TieredTensor:
        raise NotImplementedError

    def free(self, t: TieredTensor) -> None:
        raise NotImplementedError

    def read(self, t: TieredTensor, index: Index = None) -> Tensor:
        raise NotImplementedError

    def write(self, t: TieredTensor, index: Index, value: Tensor, *, non_blocking: bool = False) -> None:
        raise NotImplementedError

    def from_tensor(self, x: Tensor, *, dtype: torch.dtype | None = None, name: str = "",
                    pinned: bool | None = None) -> TieredTensor:
        """Allocate a tensor shaped like `x` here and fill it synchronously (dtype converted)."""
        t = self.allocate(tuple(x.shape), dtype or x.dtype, pinned=pinned, name=name)
        self.write(t, None, x)
        return t

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, current={self.current_bytes}, peak={self.peak_bytes})"


# --- memory tiers ---
class _MemoryTier(Tier):
    """A tier whose payloads are plain torch tensors; read returns a live view."""

    def __init__(self, backend: Backend, name: str, capacity_bytes: int | None) -> None:
        super().__init__(name, capacity_bytes)
        self.backend = backend

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> Tensor:
        raise NotImplementedError

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, *, pinned: bool | None = None,
                 name: str = "") -> TieredTensor:
        shape = tuple(int(s) for s in shape)
        # Pinning means nothing without a device to DMA to, and nothing for device memory itself.
        pin = bool(pinned) and self.backend.is_cuda and self.kind == "host"
        t = TieredTensor(shape, dtype, self, None, name, pin)
        old_peak = self.peak_bytes
        self._charge(t.nbytes)
        try:
            t.payload = self._empty(shape, dtype, pin)
        except BaseException as e:
            self._refund(t.nbytes, old_peak)
            # The real memory ran out before our budget did (CPU's allocator raises a plain RuntimeError).
            oom = isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)
            if not oom:
                raise
            if self.backend.is_cuda and self.kind == "compute":
                mem = self.backend.device_memory()
                free = mem["total_bytes"] - mem["current_bytes"]
            else:
                free = psutil.virtual_memory().available
            raise TierFullError(self, t.nbytes, free) from e
        return t

    def free(self, t: TieredTensor) -> None:
        self._release(t)

    def read(self, t: TieredTensor, index: Index = None) -> Tensor:
        return t.payload if index is None else t.payload[index]

    def write(self, t: TieredTensor, index: Index, value: Tensor, *, non_blocking: bool = False) -> None:
        self.read(t, index).copy_(value, non_blocking=non_blocking)


class ComputeTier(_MemoryTier):
    """The compute device's memory: the GPU on CUDA, a budgeted host pool on CPU."""
    kind = "compute"

    def __init__(self, backend: Backend, capacity_bytes: int | None = None, name: str = "compute") -> None:
        super().__init__(backend, name, capacity_bytes)

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> Tensor:
        return torch.empty(shape, dtype=dtype, device=self.backend.compute_device)


class HostTier(_MemoryTier):
    """CPU RAM. Pinned (page-locked) when the backend is CUDA and pinning is asked for, per tensor or by default."""
    kind = "host"

    def __init__(self, backend: Backend, capacity_bytes: int | None = None, *, pin: bool = False,
                 name: str = "host") -> None:
        super().__init__(backend, name, capacity_bytes)
        self.pin = pin

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, *, pinned: bool | None = None,
                 name: str = "") -> TieredTensor:
        return super().allocate(shape, dtype, pinned=self.pin if pinned is None else pinned, name=name)

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> Tensor:
        return self.backend.empty_pinned(shape, dtype) if pinned else torch.empty(shape, dtype=dtype)


# --- disk tier ---
# numpy has no bfloat16: store its bits as uint16 and reinterpret on the way back.
_NP_DTYPE = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64,
             torch.bfloat16: np.uint16, torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16,
             torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_}
_TORCH_DTYPE = {np.dtype(v): k for k, v in _NP_DTYPE.items() if k is not torch.bfloat16}


def _fallocate(path: str, nbytes: int) -> None:
    """Reserve the file's blocks now: a sparse memmap that hits a full disk later dies of SIGBUS, not ENOSPC."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    finally:
        os.close(fd)


def drop_file_cache(path: str | os.PathLike) -> int:
    """Flush a file and ask the kernel to drop its cached pages, so the next read is cold; returns its size.
    Needs no root, unlike /proc/sys/vm/drop_caches; pages a live mapping still holds stay resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)       # dirty pages cannot be dropped; write them first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def drop_page_cache(t: TieredTensor) -> None:
    """drop_file_cache for a disk-tier tensor."""
    drop_file_cache(t.payload.path)


class DiskTier(Tier):
    """Each tensor is a real `.npy` file under `root_dir`, opened as a memmap per access and deleted on free.

    Mapping per access (not once) keeps no file descriptors open and lets `drop_page_cache` evict the pages,
    which it cannot do while a mapping holds them.
    """
    kind = "disk"

    def __init__(self, root_dir: str | os.PathLike, capacity_bytes: int | None = None, name: str = "disk") -> None:
        super().__init__(name, capacity_bytes)
        self.root_dir = Path(root_dir)
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self._seq = itertools.count()
        self._live: dict[int, TieredTensor] = {}
        self._owned: set[int] = set()

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, *, pinned: bool | None = None,
                 name: str = "") -> TieredTensor:
        shape = tuple(int(s) for s in shape)
        if dtype not in _NP_DTYPE:
            raise TypeError(f"disk tier cannot store {dtype}")
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", name or "tensor")
        path = str(self.root_dir / f"{next(self._seq):06d}-{stem}.npy")
        t = TieredTensor(shape, dtype, self, None, name)
        old_peak = self.peak_bytes
        self._charge(t.nbytes)
        try:
            mm = np.lib.format.open_memmap(path, mode="w+", dtype=_NP_DTYPE[dtype], shape=shape)
            offset = int(mm.offset)
            del mm
            _fallocate(path, offset + t.nbytes)
        except BaseException as e:
            self._refund(t.nbytes, old_peak)
            if os.path.exists(path):
                os.remove(path)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                raise DiskFullError(path, t.nbytes) from e
            raise
        t.payload = DiskFile(path, offset, np.dtype(_NP_DTYPE[dtype]))
        self._live[id(t)] = t
        self._owned.add(id(t))
        return t

    def open_npy(self, path: str | os.PathLike, name: str = "") -> TieredTensor:
        """Wrap an existing `.npy` (e.g. converted weights) without copying; free() leaves the file alone."""
        mm = np.load(path, mmap_mode="r")
        if mm.dtype not in _TORCH_DTYPE or mm.dtype.hasobject or not mm.flags.c_contiguous:
            raise TypeError(f"{path}: unsupported .npy layout ({mm.dtype}, C-order required)")
        t = TieredTensor(tuple(mm.shape), _TORCH_DTYPE[mm.dtype], self,
                         DiskFile(str(path), int(mm.offset), mm.dtype), name or Path(path).stem)
        self._live[id(t)] = t
        return t

    def _map(self, t: TieredTensor, index: Index, mode: str) -> Tensor:
        f: DiskFile = t.payload
        if f is None:
            raise RuntimeError(f"use of freed {t!r}")
        if t.numel == 0:                     # mmap cannot map zero bytes
            return torch.empty(region_shape(t.shape, index), dtype=t.dtype)
        arr = np.memmap(f.path, dtype=f.np_dtype, mode=mode, offset=f.offset, shape=t.shape)
        x = torch.from_numpy(arr)
        if t.dtype is torch.bfloat16:
            x = x.view(torch.bfloat16)
        return x if index is None else x[index]

    def read(self, t: TieredTensor, index: Index = None) -> Tensor:
        """Zero-copy view of `t[index]`. A private (copy-on-write) mapping: writing to it never reaches the file."""
        return self._map(t, index, "c")

    def torch_view(self, t: TieredTensor, index: Index = None) -> Tensor:
        """Shared, writable zero-copy view: writes land in the file."""
        return self._map(t, index, "r+")

    def write(self, t: TieredTensor, index: Index, value: Tensor, *, non_blocking: bool = False) -> None:
        if t.numel:
            self._map(t, index, "r+").copy_(value)

    def free(self, t: TieredTensor) -> None:
        path = t.payload.path if t.payload is not None else None
        if id(t) in self._owned:
            self._release(t)
            self._owned.discard(id(t))
            if os.path.exists(path):
                os.remove(path)
        elif t.payload is None:
            raise RuntimeError(f"double free of {t!r}")
        else:
            t.payload = None
        self._live.pop(id(t), None)

    def drop_page_cache(self, t: TieredTensor) -> None:
        drop_page_cache(t)

    def close(self) -> None:
        """Free (delete) every tensor still allocated here."""
        for t in list(self._live.values()):
            self.free(t)


# --- mixed tier ---
class MixedTier(Tier):
    """Splits each tensor along `dim` across `tiers` by `fracs` (boundaries rounded to `granule` rows).

    For KV, dim is the batch dim and granule 1: whole sequences per tier, never a split by token position.
    """
    kind = "mixed"

    def __init__(self, tiers: Sequence[Tier], fracs: Sequence[float], *, dim: int = 0, granule: int = 1,
                 name: str = "mixed") -> None:
        super().__init__(name)
        if len(tiers) != len(fracs) or not 1 <= len(tiers) <= 3:
            raise ValueError("a mixed tier needs one to three tiers and one fraction each")
        self.tiers, self.fracs, self.dim, self.granule = list(tiers), list(fracs), dim, granule
        split_sizes(1, self.fracs)    # validate the fractions now, not at first allocation

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, *, pinned: bool | None = None,
                 name: str = "") -> MixedTensor:
        shape = tuple(int(s) for s in shape)
        segments: list[Segment] = []
        start = 0
        try:
            for i, (tier, n) in enumerate(zip(self.tiers, split_sizes(shape[self.dim], self.fracs, self.granule))):
                if n:
                    part = shape[:self.dim] + (n,) + shape[self.dim + 1:]
                    seg_t = tier.allocate(part, dtype, pinned=pinned, name=f"{name}.{i}" if name else "")
                    segments.append(Segment(start, start + n, seg_t))
                start += n
        except BaseException:
            for s in segments:              # no half-allocated tensor leaks bytes on the other tiers
                s.tensor.free()
            raise
        t = MixedTensor(shape, dtype, self, segments, name, dim=self.dim, segments=segments)
        self._charge(t.nbytes)
        return t

    def free(self, t: TieredTensor) -> None:
        for s in t.segments:
            s.tensor.free()
        self._release(t)
        t.segments = []

    def read(self, t: TieredTensor, index: Index = None, *, device: torch.device | str = "cpu") -> Tensor:
        """Gather `t[index]` (slices only) into a new tensor on `device`."""
        out = torch.empty(region_shape(t.shape, index), dtype=t.dtype, device=device)
        for seg, seg_idx, rel in t.locate(index):
            out[rel].copy_(seg.tensor.read(seg_idx))
        return out

    def write(self, t: TieredTensor, index: Index, value: Tensor, *, non_blocking: bool = False) -> None:
        value = value.expand(region_shape(t.shape, index))
        for seg, seg_idx, rel in t.locate(index):
            seg.tensor.tier.write(seg.tensor, seg_idx, value[rel], non_blocking=non_blocking)
