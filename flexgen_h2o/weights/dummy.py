"""Deterministic dummy weights: right shapes and scale, no checkpoint needed.

Matrices are N(0, 0.02) like a freshly initialised model, norm gains are ones and biases zeros, so activations
stay in range and nothing is an all-ones matrix (which would make every attention score tie). Each tensor's
stream is seeded from `(seed, crc32(spec.name))`, a hash that is stable across processes (unlike `hash()`), so
a tensor is the same whether made alone, in any order, or streamed into a store in chunks.
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from flexgen_h2o.models import ModelConfig, WeightSpec, all_specs, build_layers
from flexgen_h2o.weights.store import DTYPE, WeightStoreError, default_store_path
from flexgen_h2o.weights.writer import StoreWriter

DUMMY_STD = 0.02
_CHUNK = 1 << 22   # elements generated at a time: bounds the fp32 scratch to 16 MiB for any tensor size


def iter_dummy_chunks(spec: WeightSpec, seed: int = 0, chunk: int = _CHUNK) -> Iterator[np.ndarray]:
    """The flat fp16 values of `spec`'s dummy tensor, in C order, `chunk` elements at a time."""
    if spec.init not in ("normal", "ones", "zeros"):
        raise WeightStoreError(f"{spec.name}: unknown init {spec.init!r}")
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    left = spec.numel
    while left > 0:
        n = min(chunk, left)
        if spec.init == "normal":
            # one generator drawn in sequence gives the same numbers whatever the chunk size
            yield (rng.standard_normal(n, dtype=np.float32) * DUMMY_STD).astype(DTYPE)
        else:
            yield (np.ones if spec.init == "ones" else np.zeros)(n, dtype=DTYPE)
        left -= n


def dummy_tensor(spec: WeightSpec, seed: int = 0) -> np.ndarray:
    """The fp16 dummy tensor of `spec`, same bytes on every call and machine for the same (name, seed)."""
    out = np.empty(spec.numel, dtype=DTYPE)
    pos = 0
    for part in iter_dummy_chunks(spec, seed):
        out[pos:pos + part.size] = part
        pos += part.size
    return out.reshape(spec.shape)


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
    with StoreWriter(dest, cfg, source=f"dummy(seed={seed})") as writer:
        for spec in tqdm(specs, desc=f"dummy {cfg.name}", unit="tensor", disable=not progress):
            writer.write_chunks(spec.name, spec.shape, iter_dummy_chunks(spec, seed))
        return writer.commit()
