"""WeightPlacement: the home tier of every weight tensor, and staging a layer's weights for compute.

FlexGen's rule (its `init_weight_list`): per schedule layer, tensors in spec order; the midpoint of each tensor's
cumulative byte range falls in a band ordered disk, host, compute, and that band is its home. So `--percent 20 80`
puts about 20 % of each layer's bytes on the compute tier, by whole tensors.

Homes:
- compute: kept in the compute dtype; on a CPU matrices stay fp16 (`resident_dtype`), as host-homed ones do;
- host: fp16 in RAM (pinned on CUDA when pin_weight);
- disk: the store's own .npy files, read with plain positioned reads at every stage (the path that streams).
  Not through a long-lived memmap: every page touched through a mapping stays in the process's RSS, so a
  model streamed from disk would look (and, under pressure, behave) as if it were resident.

With a compressed format (--compress-weight, weights/compressed.py) the packed matrices are held, read and
staged as their uint8 rows on every tier; a CPU multiplies them in place (quant.PackedMatrix, dequantized beside
the product), a GPU dequantizes them into its fp16 buffer when they arrive.
"""
from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from flexgen_h2o.formats import WEIGHT_FORMAT, StorageFormat
from flexgen_h2o.memory import release_free_heap
from flexgen_h2o.models.layer import WeightSpec
from flexgen_h2o.quant import PackedMatrix
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


def weight_homes(layers: list, fractions: tuple[float, float, float],
                 fmt: StorageFormat = WEIGHT_FORMAT) -> dict[str, str]:
    """Every tensor's home tier, by FlexGen's midpoint rule over each model layer's stored bytes (in `fmt`): the
    one decision the engine's placement and the planner's count share. A tied tensor keeps its first layer's."""
    homes: dict[str, str] = {}
    packed = packed_names(layers)
    for layer in layers:
        specs = layer.weight_specs()
        for spec, home in zip(specs, choose_home([stored_bytes(s, fmt, packed) for s in specs], fractions)):
            homes.setdefault(spec.name, home)
    return homes


def packed_names(layers: list) -> set[str]:
    """The matrices a compressed format packs: 2-d, multiplied, and not an embedding table (a head tied to the
    token embedding is that table, read by row too, so it stays fp16 with the norms and biases)."""
    tables = {s.name for layer in layers for s in layer.weight_specs() if is_lookup_table(layer, s)}
    return {s.name for layer in layers for s in layer.weight_specs()
            if len(s.shape) == 2 and not is_lookup_table(layer, s) and s.name not in tables}


def stored_bytes(spec: WeightSpec, fmt: StorageFormat, packed: set[str]) -> int:
    """Bytes a weight takes at rest: its packed rows for a packed matrix of a quantized format, else fp16."""
    if fmt.quantized and spec.name in packed:
        return spec.shape[0] * fmt.row_width(spec.shape[1])
    return WEIGHT_FORMAT.nbytes(spec.numel)


def model_bytes(layers: list, fmt: StorageFormat = WEIGHT_FORMAT) -> int:
    """The model's stored size in `fmt` (packed matrices' rows, fp16 for the rest; a tied tensor once)."""
    packed = packed_names(layers) if fmt.quantized else set()
    unique = {s.name: s for layer in layers for s in layer.weight_specs()}
    return sum(stored_bytes(s, fmt, packed) for s in unique.values())


def resident_dtype(shape: tuple[int, ...], device: torch.device, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a compute-homed weight is kept in. On a CPU a matrix stays fp16: ops.linear upcasts it a few MB
    of rows at a time, which was no slower than an fp32 copy (`docs/architecture.md` "Numerics") and halves the
    weights' RAM, which the KV of more sequences can use. Vectors (norms, biases) and every weight on a GPU: the
    compute dtype."""
    return torch.float16 if device.type == "cpu" and len(shape) > 1 else compute_dtype


def is_lookup_table(layer, spec: WeightSpec) -> bool:
    """Embedding tables (tokens, learned positions) are read by row, never multiplied."""
    return layer.kind == "embed" and spec.key.startswith("embed_")


class WeightPlacement:
    def __init__(self, layers: list, read: Callable[[str], np.ndarray], fractions: tuple[float, float, float], *,
                 device: torch.device, compute_dtype: torch.dtype, pin: Callable[[Tensor], Tensor] = lambda t: t,
                 pin_weight: bool = True, locate: Callable[[str], tuple[Path, int, int]] | None = None,
                 pool: StagingPool | None = None, tiers: Mapping | None = None, uncached_disk: bool = False,
                 fmt: StorageFormat = WEIGHT_FORMAT):
        """read: name -> fp16 array (uint8 rows for a matrix `fmt` packs: weights.compressed gives such a
        reader); locate (a store's): name -> (file, offset, bytes) for disk-homed reads;
        pool: where staged copies land (None: fresh tensors, unaccounted); tiers: the engine's "compute" and
        "host" tiers, charged for the resident weights (None: plain tensors, unaccounted); uncached_disk: every
        disk read bypasses the page cache afterwards (staging.read_file_range), so each pass reads the device."""
        self.layers = layers
        self.device, self.compute_dtype = device, compute_dtype
        self.pool, self._pin, self.uncached_disk = pool, pin, uncached_disk
        self._count_lock = threading.Lock()
        self._handles: list = []                  # tier allocations of resident weights, freed by close()
        self.fmt = fmt
        self.packed = packed_names(layers) if fmt.quantized else set()
        self._resident_layers: dict[int, dict] = {}      # layer -> its staged weights, where all are resident
        self._resident_ids: set[int] = set()
        self.home_of = weight_homes(layers, fractions, fmt)
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
                    self._disk[spec.name] = (*locate(spec.name), self.stored_shape(spec))
                    self.resident_bytes["disk"] += stored_bytes(spec, fmt, self.packed)
                    continue
                array = read(spec.name)
                if tuple(array.shape) != self.stored_shape(spec):
                    raise ValueError(f"weight {spec.name}: shape {tuple(array.shape)} != expected "
                                     f"{self.stored_shape(spec)}")
                packed = spec.name in self.packed
                if home == "compute":
                    dtype = torch.uint8 if packed else resident_dtype(spec.shape, device, compute_dtype)
                    t = self._resident(tiers, "compute", spec, dtype, pinned=False)
                    self._compute[spec.name] = t.copy_(torch.from_numpy(np.ascontiguousarray(array)))
                    self.resident_bytes["compute"] += t.nbytes
                elif home == "host":
                    t = self._resident(tiers, "host", spec, torch.uint8 if packed else torch.float16,
                                       pinned=pin_weight)
                    self._host[spec.name] = t.copy_(torch.from_numpy(np.ascontiguousarray(array)))
                    self.resident_bytes["host"] += t.nbytes
                else:
                    self._disk[spec.name] = array
                    self.resident_bytes["disk"] += array.nbytes
        # placing (packing, drawing dummy weights) left freed blocks between live ones: hand their pages back, or
        # they stay in the RSS beyond the placed bytes (`docs/architecture.md` "Memory accounting")
        release_free_heap()

    def stored_shape(self, spec: WeightSpec) -> tuple[int, ...]:
        """The shape a weight is held in: its packed rows (n, row_width(k)) for a packed matrix."""
        if spec.name in self.packed:
            return spec.shape[0], self.fmt.row_width(spec.shape[1])
        return tuple(spec.shape)

    def _resident(self, tiers: Mapping | None, kind: str, spec: WeightSpec, dtype: torch.dtype,
                  pinned: bool) -> Tensor:
        shape = self.stored_shape(spec) if dtype == torch.uint8 else tuple(spec.shape)
        if tiers is None:
            device = self.device if kind == "compute" else torch.device("cpu")
            t = torch.empty(shape, dtype=dtype, device=device)
            return self._pin(t) if pinned else t
        handle = tiers[kind].allocate(shape, dtype, pinned=pinned, name=spec.name)
        self._handles.append(handle)
        return handle.payload

    def close(self) -> None:
        """Free the resident weights' tier allocations and the idle staging buffers."""
        for handle in self._handles:
            handle.free()
        self._handles, self._compute, self._host = [], {}, {}
        self._resident_layers.clear()
        self._resident_ids.clear()
        if self.pool is not None:
            self.pool.clear()

    def layer_bytes(self, index: int) -> int:
        """Bytes one stage(index) reads as whole tensors (embedding tables are read by row)."""
        layer = self.layers[index]
        return sum(stored_bytes(s, self.fmt, self.packed) for s in layer.weight_specs() if not is_lookup_table(layer, s))

    def stage(self, index: int) -> Mapping[str, Tensor | RowLookup]:
        """The layer's weights on the compute device (see _stage_one for dtypes). Offloaded embedding tables come as a
        RowLookup (resident ones stay fp16 tensors: a lookup needs no conversion of the whole table). Give
        the result back with release() once its last batch has computed."""
        if index in self._resident_layers:
            return self._resident_layers[index]
        layer = self.layers[index]
        staged: dict[str, Tensor | RowLookup] = {}
        for spec in layer.weight_specs():
            if is_lookup_table(layer, spec):
                staged[spec.key] = self._stage_lookup(spec)
            else:
                staged[spec.key] = self._stage_one(spec)
        if all(self.home_of[s.name] == "compute" and s.name not in self.packed for s in layer.weight_specs()):
            # every weight used where it lies: the same tensors each time, staged once (nothing to give back)
            self._resident_layers[index] = staged
            self._resident_ids.add(id(staged))
        return staged

    def release(self, staged: Mapping[str, Tensor | RowLookup]) -> None:
        if self.pool is not None and id(staged) not in self._resident_ids:
            for t in staged.values():
                if isinstance(t, PackedMatrix):
                    t = t.rows
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

    def _stage_one(self, spec: WeightSpec) -> Tensor | PackedMatrix:
        """A weight on the compute device. Matrices keep the store's fp16 (ops.linear upcasts them by blocks of
        rows on a CPU; on CUDA fp16 is the compute dtype), so a CPU stage moves 2 bytes per weight, not 2 + 4,
        and a host-homed matrix on a CPU is used where it lies. Vectors (norms, biases) take the compute dtype.
        A packed matrix moves as its uint8 rows: a CPU multiplies them as they are (PackedMatrix), a GPU
        dequantizes them into a pooled buffer of the compute dtype."""
        home = self.home_of[spec.name]
        packed = spec.name in self.packed
        if home == "compute" and not packed:
            return self._compute[spec.name]
        shape = self.stored_shape(spec)
        on_host = self.device.type == "cpu"
        dtype = torch.uint8 if packed else torch.float16 if len(shape) > 1 else self.compute_dtype
        scratch = None
        if home == "compute":
            src = self._compute[spec.name]
        elif home == "host":
            src = self._host[spec.name]
        elif isinstance(self._disk[spec.name], tuple):
            path, offset, _, _ = self._disk[spec.name]
            # on CPU the stored bytes land in a pooled buffer; on CUDA in a fresh host tensor
            stored = torch.uint8 if packed else torch.float16
            scratch = self._take(shape, stored) if on_host else torch.empty(shape, dtype=stored)
            src = read_file_range(path, offset, scratch, uncached=self.uncached_disk)
        else:
            src = torch.from_numpy(np.ascontiguousarray(self._disk[spec.name]))
        if home != "compute":
            self._count(self.bytes_read, home, src.nbytes)
        in_ram_dummy = home == "disk" and scratch is None and not packed     # copied, as before compression
        if on_host and dtype == src.dtype and not in_ram_dummy:   # used where it lies (a disk read: its buffer)
            return PackedMatrix(src, spec.shape[1], self.fmt.quant_for(spec.shape[1])) if packed else src
        if packed:                                # a GPU: the packed bytes cross, then become fp16 there
            out = self.fmt.stage(src, self.device, self.compute_dtype,
                                 into=self._take(tuple(spec.shape), self.compute_dtype), non_blocking=True)
        else:
            out = WEIGHT_FORMAT.stage(src, self.device, dtype, into=self._take(shape, dtype), non_blocking=True)
        if scratch is not None and on_host and self.pool is not None:
            self.pool.give(scratch)
        return out

    def summary(self) -> dict[str, int]:
        return {tier: int(self.resident_bytes.get(tier, 0)) for tier in TIERS}
