"""StagingBuffers: the reused CPU buffers a KV cache stages its windows into (kv/cache.py's stage)."""
from __future__ import annotations

import threading
from collections import defaultdict

import torch
from torch import Tensor


class StagingBuffers:
    """Reused flat buffers for staged KV windows on a CPU. A fresh multi-MB tensor per (layer, step) is a fresh
    allocation whose pages fault on first touch, and they are freed on another thread than the one that made
    them. With fresh windows an H2O decode step grew slower over a long generation; with this pool its first and
    last tenths of steps stay level (the suite report's first / last 10 % step table, `docs/suite.md`:
    `python -m benchmarks.suite --workload s2048+512 --systems ours-h2o-20`).
    Buffers are sized to a cache's
    capacity (one key per cache shape, however long the window) and come back when the step's KV is committed
    (KVView.release).
    Not weights.staging.StagingPool: that pool charges the compute tier, and the windows never were charged
    (the planner counts them in its workspace estimate), so moving them there would fail budgeted runs that
    pass today."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[Tensor]] = defaultdict(list)
        self._lock = threading.Lock()          # taken on the copy worker, given back after the commit

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        with self._lock:
            free = self._free[(numel, dtype)]
            if free:
                return free.pop()
        return torch.empty(numel, dtype=dtype)

    def give(self, *flats: Tensor) -> None:
        with self._lock:
            for flat in flats:
                self._free[(flat.numel(), flat.dtype)].append(flat)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
