"""WeightPlacement: the home tier of every weight tensor, and staging a layer's weights for compute.

FlexGen's rule (ANCHORS.md §1.4): per schedule layer, tensors in spec order; the midpoint of each tensor's
cumulative byte range falls in a band ordered disk, host, compute, and that band is its home. So `--percent 20 80`
puts about 20 % of each layer's bytes on the compute tier, by whole tensors.

Homes:
- compute: kept in the compute dtype; on a CPU matrices stay fp16 (`resident_dtype`), as host-homed ones do;
- host: fp16 in RAM (pinned on CUDA when pin_weight);
- disk: the store's own .npy files, read with plain positioned reads at every stage (the path that streams).
  Not through a long-lived memmap: every page touched through a mapping stays in the process's RSS, so a
  model streamed from disk would look (and, under pressure, behave) as if it were resident.
"""
from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from flexgen_h2o.formats import WEIGHT_FORMAT
from flexgen_h2o.models.layer import WeightSpec
from flexgen_h2o.weights.staging import RowLookup, StagingPool, file_rows, host_rows, read_file_range

TIERS = ("disk", "host", "compute")


def choose_home(sizes: list[int], fractions: tuple[float, float, float]) -> list[str]:
    """fractions = (compute, host, disk); bands are laid out disk, host, compute over the layer's bytes."""
    compute, host, disk = fractions
    total = float(sum(sizes)) or 1.0
    bounds = (disk, disk + host, 1.0 + 1e-9)
    homes, cum = [], 0
    for size in sizes:
        mid = (cum + size / 2) / total
        cum += size
        homes.append(next(t for t, b in zip(TIERS, bounds) if mid < b))
    return homes


def weight_homes(layers: list, fractions: tuple[float, float, float]) -> dict[str, str]:
    """Every tensor's home tier, by FlexGen's midpoint rule over each model layer's bytes: the one decision the
    engine's placement and the planner's count share. A tied tensor keeps the home of its first layer."""
    homes: dict[str, str] = {}
    for layer in layers:
        specs = layer.weight_specs()
        for spec, home in zip(specs, choose_home([WEIGHT_FORMAT.nbytes(s.numel) for s in specs], fractions)):
            homes.setdefault(spec.name, home)
    return homes


def resident_dtype(shape: tuple[int, ...], device: torch.device, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a compute-homed weight is kept in. On a CPU a matrix stays fp16: ops.linear upcasts it a few MB
    of rows at a time, which on 2 cores was no slower than an fp32 copy (SmolLM2 decode at batch 54, prompt 2048:
    336 ms a step with fp16 matrices against 353 ms with fp32 ones: `python -m benchmarks.studies.profile_decode
    --batch 54 --cases h2o --percent 0 100 100 0 100 0`, against `--percent 100 0 100 0 100 0`) and
    halves the weights' RAM,
    which the KV of more sequences can use. Vectors (norms, biases) and every weight on a GPU: the compute dtype."""
    return torch.float16 if device.type == "cpu" and len(shape) > 1 else compute_dtype


def is_lookup_table(layer, spec: WeightSpec) -> bool:
    """Embedding tables (tokens, learned positions) are read by row, never multiplied."""
    return layer.kind == "embed" and spec.key.startswith("embed_")


class WeightPlacement:
    def __init__(self, layers: list, read: Callable[[str], np.ndarray], fractions: tuple[float, float, float], *,
                 device: torch.device, compute_dtype: torch.dtype, pin: Callable[[Tensor], Tensor] = lambda t: t,
                 pin_weight: bool = True, locate: Callable[[str], tuple[Path, int, int]] | None = None,
                 pool: StagingPool | None = None, tiers: Mapping | None = None, uncached_disk: bool = False):
        """read: name -> fp16 array; locate (a store's): name -> (file, offset, bytes) for disk-homed reads;
        pool: where staged copies land (None: fresh tensors, unaccounted); tiers: the engine's "compute" and
        "host" tiers, charged for the resident weights (None: plain tensors, unaccounted); uncached_disk: every
        disk read bypasses the page cache afterwards (staging.read_file_range), so each pass reads the device."""
        self.layers = layers
        self.device, self.compute_dtype = device, compute_dtype
        self.pool, self._pin, self.uncached_disk = pool, pin, uncached_disk
        self._count_lock = threading.Lock()
        self._handles: list = []                  # tier allocations of resident weights, freed by close()
        self.home_of = weight_homes(layers, fractions)
        self._compute: dict[str, Tensor] = {}
        self._host: dict[str, Tensor] = {}
        self._disk: dict[str, tuple[Path, int, int, tuple[int, ...]] | np.ndarray] = {}
        self.bytes_read: Counter = Counter()      # (tier) -> bytes of whole tensors staged from that tier
        self.lookup_bytes: Counter = Counter()    # (tier) -> bytes of embedding rows read from that tier
        self.resident_bytes: Counter = Counter()  # (tier) -> bytes homed there
        placed: set[str] = set()
        for layer in layers:
            for spec in layer.weight_specs():
                if spec.name in placed:            # a tied tensor is placed once
                    continue
                placed.add(spec.name)
                home = self.home_of[spec.name]
                if home == "disk" and locate is not None:
                    self._disk[spec.name] = (*locate(spec.name), tuple(spec.shape))
                    self.resident_bytes["disk"] += WEIGHT_FORMAT.nbytes(spec.numel)
                    continue
                array = read(spec.name)
                if tuple(array.shape) != tuple(spec.shape):
                    raise ValueError(f"weight {spec.name}: shape {tuple(array.shape)} != expected {spec.shape}")
                if home == "compute":
                    t = self._resident(tiers, "compute", spec, resident_dtype(spec.shape, device, compute_dtype),
                                       pinned=False)
                    self._compute[spec.name] = t.copy_(torch.from_numpy(np.ascontiguousarray(array)))
                    self.resident_bytes["compute"] += t.nbytes
                elif home == "host":
                    t = self._resident(tiers, "host", spec, torch.float16, pinned=pin_weight)
                    self._host[spec.name] = t.copy_(torch.from_numpy(np.ascontiguousarray(array)))
                    self.resident_bytes["host"] += t.nbytes
                else:
                    self._disk[spec.name] = array
                    self.resident_bytes["disk"] += array.nbytes

    def _resident(self, tiers: Mapping | None, kind: str, spec: WeightSpec, dtype: torch.dtype,
                  pinned: bool) -> Tensor:
        if tiers is None:
            device = self.device if kind == "compute" else torch.device("cpu")
            t = torch.empty(tuple(spec.shape), dtype=dtype, device=device)
            return self._pin(t) if pinned else t
        handle = tiers[kind].allocate(tuple(spec.shape), dtype, pinned=pinned, name=spec.name)
        self._handles.append(handle)
        return handle.payload

    def close(self) -> None:
        """Free the resident weights' tier allocations and the idle staging buffers."""
        for handle in self._handles:
            handle.free()
        self._handles, self._compute, self._host = [], {}, {}
        if self.pool is not None:
            self.pool.clear()

    def layer_bytes(self, index: int) -> int:
        """Bytes one stage(index) reads as whole tensors (embedding tables are read by row)."""
        layer = self.layers[index]
        return sum(WEIGHT_FORMAT.nbytes(s.numel) for s in layer.weight_specs() if not is_lookup_table(layer, s))

    def stage(self, index: int) -> Mapping[str, Tensor | RowLookup]:
        """The layer's weights on the compute device (see _stage_one for dtypes). Offloaded embedding tables come as a
        RowLookup (resident ones stay fp16 tensors: a lookup needs no conversion of the whole table). Give
        the result back with release() once its last batch has computed."""
        layer = self.layers[index]
        staged: dict[str, Tensor | RowLookup] = {}
        for spec in layer.weight_specs():
            if is_lookup_table(layer, spec):
                staged[spec.key] = self._stage_lookup(spec)
            else:
                staged[spec.key] = self._stage_one(spec)
        return staged

    def release(self, staged: Mapping[str, Tensor | RowLookup]) -> None:
        if self.pool is not None:
            for t in staged.values():
                if isinstance(t, Tensor):
                    self.pool.give(t)

    def _count(self, counter: Counter, home: str, nbytes: int) -> None:
        with self._count_lock:                   # stage() runs on a copy worker, lookups on the main thread
            counter[home] += nbytes

    def _stage_lookup(self, spec: WeightSpec) -> Tensor | RowLookup:
        home = self.home_of[spec.name]
        if home == "compute":
            return self._compute[spec.name]
        if home == "host":
            rows = host_rows(self._host[spec.name])
        elif isinstance(self._disk[spec.name], tuple):
            path, offset, _, shape = self._disk[spec.name]
            rows = file_rows(path, offset, shape)
        else:
            rows = host_rows(torch.from_numpy(self._disk[spec.name]))     # dummy weights kept in RAM
        return RowLookup(tuple(spec.shape), rows, self.device, lambda n: self._count(self.lookup_bytes, home, n))

    def _take(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        if self.pool is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self.pool.take(shape, dtype)

    def _stage_one(self, spec: WeightSpec) -> Tensor:
        """A weight on the compute device. Matrices keep the store's fp16 (ops.linear upcasts them by blocks of
        rows on a CPU; on CUDA fp16 is the compute dtype), so a CPU stage moves 2 bytes per weight, not 2 + 4,
        and a host-homed matrix on a CPU is used where it lies. Vectors (norms, biases) take the compute dtype."""
        home = self.home_of[spec.name]
        if home == "compute":
            return self._compute[spec.name]
        shape = tuple(spec.shape)
        on_host = self.device.type == "cpu"
        dtype = torch.float16 if len(shape) > 1 else self.compute_dtype
        if home == "host":
            src, scratch = self._host[spec.name], None
            if on_host and dtype == src.dtype:
                self._count(self.bytes_read, home, src.nbytes)
                return src
        elif isinstance(self._disk[spec.name], tuple):
            path, offset, _, _ = self._disk[spec.name]
            # on CPU the fp16 bytes land in a pooled buffer; on CUDA in a fresh host tensor
            scratch = self._take(shape, torch.float16) if on_host else torch.empty(shape, dtype=torch.float16)
            src = read_file_range(path, offset, scratch, uncached=self.uncached_disk)
            if on_host and dtype == src.dtype:
                self._count(self.bytes_read, home, src.nbytes)
                return src                    # the pooled buffer itself is the staged weight
        else:
            src, scratch = torch.from_numpy(np.ascontiguousarray(self._disk[spec.name])), None
        self._count(self.bytes_read, home, src.nbytes)
        out = WEIGHT_FORMAT.stage(src, self.device, dtype, into=self._take(shape, dtype), non_blocking=True)
        if scratch is not None and on_host and self.pool is not None:
            self.pool.give(scratch)
        return out

    def summary(self) -> dict[str, int]:
        return {tier: int(self.resident_bytes.get(tier, 0)) for tier in TIERS}
