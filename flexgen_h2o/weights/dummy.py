"""Deterministic dummy weights: right shapes and scale, no checkpoint needed, made at memory speed.

Matrices are N(0, 0.02) values like a freshly initialised model, norm gains are ones and biases zeros, so
activations stay in range and nothing is an all-ones matrix (which would make every attention score tie).

Drawing a normal per weight is far slower than a copy, which a model of tens of GB feels; one pool of 4 Mi
normals is drawn once, and row r of a tensor is the pool's window starting at (key + r * STRIDE) mod POOL, key from
`(seed, crc32(spec.name))` (stable across processes, unlike `hash()`). Filling a tensor is then a gather of
rows, a copy: the same bytes on every machine and device, whatever order tensors are made in or however they
are chunked. Rows of one tensor never repeat (an odd stride cycles through every start of a power-of-two pool
before coming back); windows of different rows may overlap, which matters to timings and tests not at all.
"""
from __future__ import annotations

import functools
import os
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from flexgen_h2o.models import ModelConfig, WeightSpec, all_specs, build_layers
from flexgen_h2o.weights.store import DTYPE, WeightStoreError, default_store_path
from flexgen_h2o.weights.writer import StoreWriter

DUMMY_STD = 0.02
POOL = 1 << 22                 # normals drawn once (8 MiB of fp16, held for the process's life)
WIDEST = 1 << 16               # rows up to this wide are windows of the one cached pool
STRIDE = 0x9E3779B1 % POOL | 1  # odd: every start of the pool comes once before any repeats
SOURCE = "dummy-pool-v2(seed={seed})"   # a store's manifest source; an older dummy store is written again
_CHUNK = 1 << 22               # elements yielded at a time when streaming into a store


@functools.lru_cache(maxsize=1)
def _pool(length: int) -> torch.Tensor:
    """The pool's normals in fp16, repeated to `length` so that a window may run past its end."""
    pool = (np.random.default_rng(0x5EED).standard_normal(POOL, dtype=np.float32) * DUMMY_STD).astype(DTYPE)
    return torch.from_numpy(np.resize(pool, length))


def _windows(width: int) -> torch.Tensor:
    """(POOL, width) fp16 view whose row i is the pool's values i, i+1, ... (wrapping), width consecutive."""
    return _pool(POOL + max(width, WIDEST)).as_strided((POOL, width), (1, 1))


def _key(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) + seed * 0x632BE5AB) % POOL


def dummy_rows(spec: WeightSpec, lo: int, hi: int, seed: int = 0) -> np.ndarray:
    """Rows lo:hi of `spec`'s dummy tensor seen as (numel / last dim, last dim), fp16, shape (hi - lo, width):
    gathered straight into one numpy array (no second copy: a transient of a weight's size moves glibc's mmap
    threshold and leaves the decode more heap; `docs/architecture.md` "Memory accounting")."""
    width = spec.shape[-1] if spec.shape else 1
    if spec.init != "normal":
        return (np.ones if spec.init == "ones" else np.zeros)((hi - lo, width), dtype=DTYPE)
    out = np.empty((hi - lo, width), dtype=DTYPE)
    starts = (_key(spec.name, seed) + torch.arange(lo, hi, dtype=torch.int64) * STRIDE) % POOL
    torch.index_select(_windows(width), 0, starts, out=torch.from_numpy(out))
    return out


def iter_dummy_chunks(spec: WeightSpec, seed: int = 0, chunk: int = _CHUNK) -> Iterator[np.ndarray]:
    """The flat fp16 values of `spec`'s dummy tensor, in C order, `chunk` elements at a time."""
    if spec.init not in ("normal", "ones", "zeros"):
        raise WeightStoreError(f"{spec.name}: unknown init {spec.init!r}")
    width = spec.shape[-1] if spec.shape else 1
    for start in range(0, spec.numel, chunk):
        stop = min(start + chunk, spec.numel)
        rows = dummy_rows(spec, start // width, (stop - 1) // width + 1, seed).reshape(-1)
        first = start - (start // width) * width
        yield rows[first:first + stop - start]


def dummy_tensor(spec: WeightSpec, seed: int = 0) -> np.ndarray:
    """The fp16 dummy tensor of `spec`, same bytes on every call and machine for the same (name, seed)."""
    if spec.init not in ("normal", "ones", "zeros"):
        raise WeightStoreError(f"{spec.name}: unknown init {spec.init!r}")
    width = spec.shape[-1] if spec.shape else 1
    return dummy_rows(spec, 0, spec.numel // width, seed).reshape(spec.shape)


class DummyStore:
    """Same `read(name)` interface as StoreReader, producing dummy tensors on demand (nothing on disk)."""

    def __init__(self, specs: Sequence[WeightSpec], seed: int = 0):
        self.specs = {s.name: s for s in specs}
        self.seed = seed
        self.tokenizer_path: Path | None = None

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def read(self, name: str) -> np.ndarray:
        spec = self.specs.get(name)
        if spec is None:
            raise WeightStoreError(f"tensor {name!r} is not part of this model")
        return dummy_tensor(spec, self.seed)


def write_dummy_store(cfg: ModelConfig, dest: str | os.PathLike | None = None, *, seed: int = 0,
                      progress: bool = True) -> Path:
    """Materialise a full dummy store on disk (e.g. for disk-tier benchmarks of models that are not
    downloaded). Streams chunk by chunk and publishes atomically, like `convert_checkpoint`."""
    dest = Path(dest).expanduser() if dest is not None else default_store_path(cfg.name + "-dummy")
    specs = all_specs(build_layers(cfg))
    with StoreWriter(dest, cfg, source=SOURCE.format(seed=seed)) as writer:
        for spec in tqdm(specs, desc=f"dummy {cfg.name}", unit="tensor", disable=not progress):
            writer.write_chunks(spec.name, spec.shape, iter_dummy_chunks(spec, seed))
        return writer.commit()
