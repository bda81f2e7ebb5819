"""Atomic, streaming store writer.

Tensors are written one at a time into a temporary sibling folder `<dest>.tmp-<pid>-<rand>`; the manifest is
written last and the folder renamed into place only on `commit`. Any exception inside the `with` block removes
the temporary folder, so an interrupted conversion never leaves a half store where a reader would find it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

from flexgen_h2o.models.config import ModelConfig
from flexgen_h2o.weights.store import DTYPE, FORMAT_VERSION, MANIFEST, TOKENIZER_DIR, WeightStoreError, npy_header

if sys.byteorder != "little":   # the store is little-endian fp16 and the writer copies raw bytes
    raise ImportError("flexgen_h2o weight stores need a little-endian machine")


def _as_fp16(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu", torch.float16).contiguous().numpy()
    return np.ascontiguousarray(x, dtype=DTYPE)


class StoreWriter:
    """`with StoreWriter(dest, cfg) as w: w.write(name, tensor) ...; w.commit()`."""

    def __init__(self, dest: str | os.PathLike, cfg: ModelConfig, *, source: str | None = None):
        self.dest = Path(dest).expanduser().absolute()
        self.cfg = cfg
        self.source = source
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.dest.parent / f"{self.dest.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        self.tmp.mkdir()
        self.tensors: dict[str, dict[str, Any]] = {}
        self._done = False

    @property
    def tokenizer_dir(self) -> Path:
        """Where to `save_pretrained` a tokenizer so that it lands in `<dest>/tokenizer/`."""
        return self.tmp / TOKENIZER_DIR

    def _path(self, name: str) -> Path:
        if "/" in name or os.sep in name or name.startswith("."):
            raise WeightStoreError(f"tensor name {name!r} cannot be a file name in a store")
        if name in self.tensors:
            raise WeightStoreError(f"tensor {name!r} written twice to {self.tmp}")
        return self.tmp / f"{name}.npy"

    def write(self, name: str, tensor: torch.Tensor | np.ndarray) -> None:
        """Write one whole tensor as fp16 (converting if needed)."""
        arr = _as_fp16(tensor)
        self.write_chunks(name, arr.shape, [arr])

    def write_chunks(self, name: str, shape: tuple[int, ...], chunks: Iterable[np.ndarray]) -> None:
        """Write one tensor from C-order fp16 pieces, so a caller never needs the whole tensor in memory."""
        path = self._path(name)
        want = int(np.prod(shape, dtype=np.int64)) * DTYPE.itemsize
        header = npy_header(shape)
        got, finite = 0, True
        with open(path, "wb") as f:
            f.write(header)
            for chunk in chunks:
                chunk = np.ascontiguousarray(chunk, dtype=DTYPE)
                finite = finite and bool(np.isfinite(chunk).all())   # on bytes already in memory: no second read
                f.write(memoryview(chunk).cast("B"))
                got += chunk.nbytes
        if got != want:
            raise WeightStoreError(f"{path}: wrote {got} data bytes for shape {list(shape)}, expected {want}")
        # finite and the file's mtime: a reader trusts the flag while the file is the one written (store.py)
        self.tensors[name] = {"shape": [int(s) for s in shape], "dtype": "float16",
                              "bytes": len(header) + want, "file": path.name, "finite": finite,
                              "mtime_ns": os.stat(path).st_mtime_ns}

    def commit(self) -> Path:
        """Write the manifest and move the finished store to `dest` (replacing an old store there)."""
        manifest = {"format": FORMAT_VERSION, "model": self.cfg.name, "config": dataclasses.asdict(self.cfg),
                    "tensors": self.tensors}
        if self.source:
            manifest["source"] = self.source
        if self.tokenizer_dir.is_dir():
            manifest["tokenizer"] = TOKENIZER_DIR
        with open(self.tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
        old = None
        if self.dest.exists():
            # os.replace cannot overwrite a non-empty folder: park the old store aside, swap, then delete it
            old = self.dest.parent / f"{self.dest.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.replace(self.dest, old)
        os.replace(self.tmp, self.dest)
        self._done = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.dest

    def abort(self) -> None:
        if not self._done:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self._done = True

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        # also covers a block that returned without commit: a store is only ever published complete
        self.abort()
