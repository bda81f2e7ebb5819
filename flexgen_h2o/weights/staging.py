"""Staging buffers for offloaded weights, and row lookups for offloaded embedding tables.

StagingPool: every staged weight lands in a buffer taken from the compute tier, so the engine's accounting sees
the staging working set (about two schedule layers: the one computing and the one prefetched). On CPU the
buffers are reused: a fresh multi-MB tensor is a fresh mmap whose every page faults on first touch, which made
staging from the page cache run at a third of memcpy speed. On CUDA the caching allocator already recycles
device memory, and a buffer freed by the host may still be read by queued kernels, so there the pool only
accounts and frees.

RowLookup: an embedding lookup reads b*t rows, not the table. A table homed off the compute tier is staged as a
RowLookup, which reads only the rows the ids name (the tied head still stages the whole table, once).
"""
from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from flexgen_h2o.formats import WEIGHT_FORMAT
from flexgen_h2o.memory.tensor import TieredTensor


class StagingPool:
    def __init__(self, tier, reuse: bool):
        """tier: the compute tier (allocate(shape, dtype) -> TieredTensor); reuse: keep freed buffers (CPU)."""
        self.tier, self.reuse = tier, reuse
        self._free: dict[tuple, list[TieredTensor]] = defaultdict(list)
        self._lent: dict[int, TieredTensor] = {}          # data_ptr -> handle of a buffer in use
        self._lock = threading.Lock()                     # taken on a copy worker, given back on the main thread

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        key = (tuple(shape), dtype)
        with self._lock:
            handle = self._free[key].pop() if self._free[key] else None
        if handle is None:
            handle = self.tier.allocate(shape, dtype, name="staged weight")
        with self._lock:
            self._lent[handle.payload.data_ptr()] = handle
        return handle.payload

    def give(self, t: Tensor) -> None:
        """Return a buffer from take(); tensors the pool did not lend (resident weights) are ignored."""
        with self._lock:
            handle = self._lent.pop(t.data_ptr(), None)
            if handle is not None and self.reuse:
                self._free[(handle.shape, handle.dtype)].append(handle)
                return
        if handle is not None:
            handle.free()

    def clear(self) -> None:
        """Free every idle buffer (the engine calls it when it closes)."""
        with self._lock:
            idle = [h for hs in self._free.values() for h in hs]
            self._free.clear()
        for h in idle:
            h.free()

    @property
    def lent_count(self) -> int:
        return len(self._lent)


def read_file_range(path: Path, offset: int, out: Tensor, uncached: bool = False) -> Tensor:
    """Fill `out` (contiguous) from bytes [offset, offset + out.nbytes) of a file; the read releases the GIL.
    uncached: drop the range from the OS page cache afterwards (POSIX_FADV_DONTNEED), so the next read of it
    comes from the device again, as for a model larger than RAM."""
    view = memoryview(out.numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < out.nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{path}: short read at byte {offset + done} (file truncated?)")
            done += n
        if uncached:
            os.posix_fadvise(fd, offset, out.nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return out


class RowLookup:
    """An embedding table staged as 'rows on demand': lookup(ids) gathers only the rows it needs."""

    def __init__(self, shape: tuple[int, int], read_rows: Callable[[Tensor], Tensor], device: torch.device,
                 count: Callable[[int], None]):
        """read_rows: sorted unique row ids (n,) -> fp16 rows (n, m) on the host; count(bytes) records reads."""
        self.shape, self._read_rows, self.device, self._count = shape, read_rows, device, count

    def lookup(self, ids: Tensor) -> Tensor:
        """ids (...) long -> rows (..., m) fp16 on the compute device."""
        unique, inverse = torch.unique(ids.cpu(), return_inverse=True)
        rows = self._read_rows(unique)
        self._count(rows.nbytes)
        return rows.to(self.device)[inverse.to(self.device)]


def host_rows(table: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda unique: table.index_select(0, unique)


def file_rows(path: Path, offset: int, shape: tuple[int, int]) -> Callable[[Tensor], Tensor]:
    """Rows of an fp16 (n, m) table stored C-order at `offset` in `path`, one positioned read per run of
    consecutive ids."""
    row_bytes = WEIGHT_FORMAT.nbytes(shape[1])

    def read(unique: Tensor) -> Tensor:
        out = torch.empty((len(unique), shape[1]), dtype=torch.float16)
        ids = unique.tolist()
        if ids and (ids[0] < 0 or ids[-1] >= shape[0]):
            raise IndexError(f"token id out of range for an embedding table of {shape[0]} rows")
        start = 0
        while start < len(ids):
            stop = start + 1
            while stop < len(ids) and ids[stop] == ids[stop - 1] + 1:
                stop += 1
            read_file_range(path, offset + ids[start] * row_bytes, out[start:stop])
            start = stop
        return out
    return read
