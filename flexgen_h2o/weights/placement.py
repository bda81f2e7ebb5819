"""WeightPlacement: the home tier of every weight tensor, and staging a layer's weights for compute.

FlexGen's rule (ANCHORS.md §1.4): per schedule layer, tensors in spec order; the midpoint of each tensor's
cumulative byte range falls in a band ordered disk, host, compute, and that band is its home. So `--percent 20 80`
puts about 20 % of each layer's bytes on the compute tier, by whole tensors.

Homes:
- compute: converted once to the compute dtype (fp32 on CPU, where fp16 matmul is ~500x slower) and kept;
- host: fp16 in RAM (pinned on CUDA when pin_weight);
- disk: the store's own .npy files, read with plain positioned reads at every stage (the path that streams).
  Not through a long-lived memmap: every page touched through a mapping stays in the process's RSS, so a
  model streamed from disk would look (and, under pressure, behave) as if it were resident.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch
from torch import Tensor

from flexgen_h2o.models.layer import WeightSpec

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


def read_file_range(path: Path, offset: int, nbytes: int, shape: tuple[int, ...]) -> Tensor:
    """fp16 tensor from bytes [offset, offset + nbytes) of a file, read into a fresh buffer (GIL released)."""
    out = torch.empty(shape, dtype=torch.float16)
    view = memoryview(out.numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"{path}: short read at byte {offset + done} (file truncated?)")
            done += n
    finally:
        os.close(fd)
    return out


class WeightPlacement:
    def __init__(self, layers: list, read: Callable[[str], np.ndarray], fractions: tuple[float, float, float], *,
                 device: torch.device, compute_dtype: torch.dtype, pin: Callable[[Tensor], Tensor] = lambda t: t,
                 pin_weight: bool = True, locate: Callable[[str], tuple[Path, int, int]] | None = None):
        """read: name -> fp16 array; locate (a store's): name -> (file, offset, bytes) for disk-homed reads."""
        self.layers = layers
        self.device, self.compute_dtype = device, compute_dtype
        self.home_of: dict[str, str] = {}
        self._compute: dict[str, Tensor] = {}
        self._host: dict[str, Tensor] = {}
        self._disk: dict[str, tuple[Path, int, int, tuple[int, ...]] | np.ndarray] = {}
        self.bytes_read: Counter = Counter()      # (tier) -> bytes staged from that tier
        self.resident_bytes: Counter = Counter()  # (tier) -> bytes homed there
        for layer in layers:
            specs = layer.weight_specs()
            homes = choose_home([s.numel * 2 for s in specs], fractions)
            for spec, home in zip(specs, homes):
                if spec.name in self.home_of:      # a tied tensor keeps its first home
                    continue
                self.home_of[spec.name] = home
                if home == "disk" and locate is not None:
                    self._disk[spec.name] = (*locate(spec.name), tuple(spec.shape))
                    self.resident_bytes["disk"] += spec.numel * 2
                    continue
                array = read(spec.name)
                if tuple(array.shape) != tuple(spec.shape):
                    raise ValueError(f"weight {spec.name}: shape {tuple(array.shape)} != expected {spec.shape}")
                if home == "compute":
                    self._compute[spec.name] = torch.from_numpy(np.ascontiguousarray(array)).to(
                        device=device, dtype=compute_dtype)
                    self.resident_bytes["compute"] += self._compute[spec.name].nbytes
                elif home == "host":
                    t = torch.from_numpy(np.array(array, dtype=np.float16))
                    self._host[spec.name] = pin(t) if pin_weight else t
                    self.resident_bytes["host"] += t.nbytes
                else:
                    self._disk[spec.name] = array
                    self.resident_bytes["disk"] += array.nbytes

    def layer_bytes(self, index: int) -> int:
        return sum(s.numel * 2 for s in self.layers[index].weight_specs())

    def stage(self, index: int) -> Mapping[str, Tensor]:
        """The layer's weights on the compute device, in compute dtype (embedding tables stay fp16: a lookup
        only reads b*t rows, so converting the whole table would be wasted work; OPT's project_in is a matmul
        and does get the compute dtype)."""
        layer = self.layers[index]
        staged: dict[str, Tensor] = {}
        for spec in layer.weight_specs():
            keep_storage_dtype = layer.kind == "embed" and spec.key.startswith("embed_")   # lookup tables
            staged[spec.key] = self._stage_one(spec, keep_storage_dtype)
        return staged

    def _stage_one(self, spec: WeightSpec, keep_storage_dtype: bool) -> Tensor:
        home = self.home_of[spec.name]
        if home == "compute":
            return self._compute[spec.name]
        dtype = torch.float16 if keep_storage_dtype else self.compute_dtype
        if home == "host":
            src = self._host[spec.name]
        elif isinstance(self._disk[spec.name], tuple):
            src = read_file_range(*self._disk[spec.name])                        # reads the file
        else:
            src = torch.from_numpy(np.ascontiguousarray(self._disk[spec.name]))   # dummy weights kept in RAM
        self.bytes_read[home] += src.nbytes
        return src.to(device=self.device, dtype=dtype, non_blocking=True)

    def summary(self) -> dict[str, int]:
        return {tier: int(self.resident_bytes.get(tier, 0)) for tier in TIERS}
