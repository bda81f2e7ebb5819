"""Tiers: where a TieredTensor's bytes live, and the engine's own byte accounting for each place.

ComputeTier (the GPU on CUDA; a budgeted host pool on CPU, so placements like `--percent 20 80` mean the same
thing everywhere), HostTier (CPU RAM, optionally pinned) and DiskTier (one real `.npy` file per tensor). FlexGen's
TorchDevice / TorchDisk. Every tier counts `current_bytes` and `peak_bytes` of what it handed
out; the engine reads and writes the payloads (or a disk tensor's `torch_view`) itself.
"""
from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import re
import struct
import threading
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np
import psutil
import torch
from torch import Tensor

from ..backend.base import Backend
from .tensor import DiskFile, TieredTensor


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
    """Base: allocation bookkeeping shared by every tier. Subclasses provide allocate/free."""
    kind: ClassVar[str] = "?"

    def __init__(self, name: str, capacity_bytes: int | None = None) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.current_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()    # tensors may be allocated or freed from copy workers

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

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, *, pinned: bool | None = None,
                 name: str = "") -> TieredTensor:
        raise NotImplementedError

    def free(self, t: TieredTensor) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, current={self.current_bytes}, peak={self.peak_bytes})"


# --- memory tiers ---
class _MemoryTier(Tier):
    """A tier whose payloads are plain torch tensors."""

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


def _write_npy_header(path: str, shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> int:
    """A `.npy` file of `nbytes` data whose data starts at the next OS page (np.load reads any header length), so
    an aligned run of data is whole OS pages: a reader of scattered KV pages (kv/pages.py) faults in only its own.
    Returns the data's offset."""
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)})
    offset = -(-(len(text) + 11) // mmap.PAGESIZE) * mmap.PAGESIZE          # magic 6 + version 2 + length 2 + "\n"
    body = text + " " * (offset - 10 - len(text) - 1) + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1"))
        f.truncate(offset + nbytes)
    return offset


def drop_from_memory(x: Tensor, path: str | os.PathLike) -> None:
    """Drop a disk-homed tensor's pages from RAM, the mapping's and the page cache's, so its next read comes from
    the disk: what a step finds when the KV is larger than the RAM it may use (tests, benchmarks)."""
    page = mmap.PAGESIZE
    start = x.data_ptr() // page * page
    length = x.data_ptr() + x.numel() * x.element_size() - start
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.msync.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.msync(start, length, 4)                              # MS_SYNC: dirty pages written first
    if libc.madvise(start, length, mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
    drop_file_cache(path)


def release_free_heap() -> None:
    """glibc's malloc_trim(0): free heap pages go back to the OS wherever they lie (elsewhere: nothing)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


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


class DiskTier(Tier):
    """Each tensor is a real `.npy` file under `root_dir`, created (blocks reserved) at allocate, mapped by
    `torch_view` and deleted on free or close."""
    kind = "disk"

    def __init__(self, root_dir: str | os.PathLike, capacity_bytes: int | None = None, name: str = "disk") -> None:
        super().__init__(name, capacity_bytes)
        self.root_dir = Path(root_dir)
        self.root_dir.mkdir(parents=True, exist_ok=True)
        self._seq = itertools.count()
        self._live: dict[int, TieredTensor] = {}     # what close() still has to delete

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
            offset = _write_npy_header(path, shape, np.dtype(_NP_DTYPE[dtype]), t.nbytes)
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
        return t

    def torch_view(self, t: TieredTensor, random: bool = False) -> Tensor:
        """Shared, writable zero-copy view of the file: writes land in it. random: a reader of scattered pages
        (kv/pages.py); the kernel then reads only the pages touched, not the ~128 KiB it reads around a fault."""
        f: DiskFile = t.payload
        if f is None:
            raise RuntimeError(f"use of freed {t!r}")
        if t.numel == 0:                     # mmap cannot map zero bytes
            return torch.empty(t.shape, dtype=t.dtype)
        array = np.memmap(f.path, dtype=f.np_dtype, mode="r+", offset=f.offset, shape=t.shape)
        if random:
            array._mmap.madvise(mmap.MADV_RANDOM)
        x = torch.from_numpy(array)
        return x.view(torch.bfloat16) if t.dtype is torch.bfloat16 else x

    def free(self, t: TieredTensor) -> None:
        path = None if t.freed else t.payload.path
        self._release(t)                     # raises on a double free, before the file is touched
        self._live.pop(id(t), None)
        if os.path.exists(path):
            os.remove(path)

    def close(self) -> None:
        """Free (delete) every tensor still allocated here."""
        for t in list(self._live.values()):
            self.free(t)
