"""The weight store on disk, and its reader.

A store is a folder with one little-endian fp16 `.npy` file per tensor (`<spec.name>.npy`, memory-mappable)
plus `manifest.json`; an optional `tokenizer/` subfolder holds a saved HF tokenizer. The manifest is written
last and the folder is renamed into place only when complete (see writer.py), so a folder with a manifest is a
whole store. Every check here names the file at fault, and sizes are checked before `np.load`, so a damaged
store gives one clear `WeightStoreError` instead of a numpy reshape traceback.

Finite values: a NaN weight runs and answers garbage with exit 0, so the writer records per tensor whether its
values are finite (`finite`) and the file's `mtime_ns` as written. Opening a store trusts the flag while the
file's mtime is the recorded one, and scans the values again only where it is not: a stat per file, where a
checksum would read the whole store at every open, which is the scan the flag saves. Any write to a file (an
overwrite, a copy over it, a truncation; `cp -r` of the store gives new mtimes, so its copy is scanned once)
changes the mtime and is caught; bit rot on the medium, which leaves the mtime alone, is not. A store written
before the flag existed is scanned once at its first open and the flags recorded then (where the store is
read-only, it is scanned at every open instead).
"""
from __future__ import annotations

import io
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from flexgen_h2o.files import write_atomic
from flexgen_h2o.formats import WEIGHT_FORMAT
from flexgen_h2o.models.config import PRESETS, ModelConfig
from flexgen_h2o.models.layer import WeightSpec

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
DTYPE = WEIGHT_FORMAT.numpy_dtype
ENV_HOME = "FLEXGEN_H2O_HOME"
SCAN_VALUES = 1 << 24          # values per slice of the finite scan: 32 MiB of fp16 at a time


class WeightStoreError(Exception):
    """A store or checkpoint that cannot be used; the message names the file or tensor and what to do."""


# --- locations ---

def store_root() -> Path:
    """`$FLEXGEN_H2O_HOME`, else `~/.cache/flexgen_h2o`."""
    env = os.environ.get(ENV_HOME)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flexgen_h2o"


def store_slug(name: str) -> str:
    """A folder name for a model name: presets stay as they are, HF ids become `org--name`, and a local
    folder path becomes `<basename>-<crc of its absolute path>` so two folders with one basename never collide."""
    if name in PRESETS:
        return name
    looks_like_path = name.startswith((".", "~", os.sep)) or os.path.isdir(os.path.expanduser(name))
    if looks_like_path:
        full = os.path.abspath(os.path.expanduser(name)).rstrip(os.sep)
        base = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(full)) or "model"
        return f"{base}-{zlib.crc32(full.encode()):08x}"
    return re.sub(r"[^A-Za-z0-9._-]+", "--", name.strip("/")) or "model"


def default_store_path(cfg_or_name: ModelConfig | str) -> Path:
    """Where the store of a model lives by default: `store_root() / store_slug(name)`."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.name
    return store_root() / store_slug(name)


# --- npy helpers ---

def npy_header(shape: Sequence[int]) -> bytes:
    """The exact .npy (v1.0) header the writer puts before the fp16 data of a tensor of this shape."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": DTYPE.str, "fortran_order": False,
                                               "shape": tuple(int(s) for s in shape)})
    return buf.getvalue()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _read_header(path: Path) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """Shape, dtype, fortran flag and data offset of an .npy file, reading only its first bytes."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        return tuple(shape), dtype, fortran, f.tell()


def check_npy(path: Path, shape: Sequence[int]) -> int:
    """Validate one tensor file against its expected shape; returns the byte offset of its data."""
    shape = tuple(int(s) for s in shape)
    if not path.is_file():
        raise WeightStoreError(f"weight store file is missing: {path}")
    size = os.path.getsize(path)
    try:
        got_shape, dtype, fortran, offset = _read_header(path)
    except (ValueError, OSError, EOFError) as e:
        raise WeightStoreError(f"weight store file {path} is not a valid .npy file ({size} bytes; {e}); "
                               "delete the store and convert again") from None
    if dtype != DTYPE or fortran:
        raise WeightStoreError(f"weight store file {path} holds {dtype} (fortran={fortran}), expected C-order "
                               "float16; delete the store and convert again")
    if got_shape != shape:
        raise WeightStoreError(f"weight store file {path} has shape {list(got_shape)}, expected {list(shape)}")
    want = offset + _numel(shape) * DTYPE.itemsize
    if size != want:
        what = "truncated" if size < want else "larger than expected"
        raise WeightStoreError(f"weight store file {path} is {what}: {size} bytes, expected {want}; "
                               "delete the store and convert again")
    return offset


def count_nonfinite(path: Path, offset: int, shape: Sequence[int]) -> int:
    """NaN and infinite values in a tensor file's data, read in slices (a whole-file mask would double RAM)."""
    n = _numel(shape)
    if n == 0:
        return 0
    data = np.memmap(path, dtype=DTYPE, mode="r", offset=offset, shape=(n,))
    bad = 0
    for lo in range(0, n, SCAN_VALUES):
        ok = np.isfinite(data[lo:lo + SCAN_VALUES])
        if not ok.all():
            bad += int(ok.size - np.count_nonzero(ok))
    return bad


def _check_finite(fpath: Path, entry: dict[str, Any], offset: int, shape: Sequence[int]) -> bool:
    """Raise naming the file if its values are not all finite; trusts the manifest's flag while the file's mtime
    is the recorded one (module doc). Returns whether `entry` was updated (scanned and found finite)."""
    mtime = os.stat(fpath).st_mtime_ns
    if entry.get("finite") is True and entry.get("mtime_ns") == mtime:
        return False
    bad = count_nonfinite(fpath, offset, shape)
    if bad:
        changed = " (it changed after conversion)" if entry.get("mtime_ns") not in (None, mtime) else ""
        raise WeightStoreError(f"weight store file {fpath} holds {bad} NaN or infinite value(s) of {_numel(shape)}"
                               f"{changed}; delete the store and convert again")
    entry["finite"], entry["mtime_ns"] = True, mtime
    return True


def _save_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Record the flags of a scan, atomically; a read-only store keeps its old manifest (scanned again later)."""
    try:
        write_atomic(root / MANIFEST, json.dumps(manifest, indent=1).encode())
    except OSError:
        pass


# --- reader ---

class StoreReader:
    """Read-only access to a validated store. `read` returns a read-only fp16 memmap (no copy)."""

    def __init__(self, path: Path, manifest: dict[str, Any], offsets: dict[str, int]):
        self.path = path
        self.manifest = manifest
        self._offsets = offsets

    @property
    def model(self) -> str:
        return self.manifest.get("model", "")

    @property
    def config(self) -> dict[str, Any]:
        """The `dataclasses.asdict(ModelConfig)` recorded at conversion time (tuples came back as lists)."""
        return self.manifest.get("config", {})

    @property
    def names(self) -> list[str]:
        return list(self.manifest["tensors"])

    @property
    def tokenizer_path(self) -> Path | None:
        tok = self.path / TOKENIZER_DIR
        return tok if tok.is_dir() else None

    def _entry(self, name: str) -> dict[str, Any]:
        entry = self.manifest["tensors"].get(name)
        if entry is None:
            raise WeightStoreError(f"tensor {name!r} is not in {self.path / MANIFEST}")
        return entry

    def file(self, name: str) -> Path:
        return self.path / self._entry(name)["file"]

    def locate(self, name: str) -> tuple[Path, int, int]:
        """(file, data offset, data bytes) for readers that bypass numpy, e.g. direct disk-tier reads."""
        entry = self._entry(name)
        path = self.path / entry["file"]
        if name not in self._offsets:
            self._offsets[name] = check_npy(path, entry["shape"])
        return path, self._offsets[name], _numel(entry["shape"]) * DTYPE.itemsize

    def read(self, name: str) -> np.ndarray:
        entry = self._entry(name)
        path, _, _ = self.locate(name)   # size checked before np.load, so no reshape traceback
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise WeightStoreError(f"cannot read weight store file {path}: {e}") from None
        if tuple(arr.shape) != tuple(entry["shape"]):
            raise WeightStoreError(f"weight store file {path} has shape {list(arr.shape)}, "
                                   f"expected {entry['shape']}")
        return arr


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Parse and sanity-check `<path>/manifest.json`."""
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        hint = "" if Path(path).is_dir() else " (the folder does not exist)"
        raise WeightStoreError(f"no weight store at {path}: {mpath} is missing{hint}; convert the weights with "
                               "`python -m flexgen_h2o.convert SRC --model NAME` or use --dummy-weights")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, OSError) as e:
        raise WeightStoreError(f"{mpath} is not valid JSON ({e}); delete the store and convert again") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tensors"), dict):
        raise WeightStoreError(f"{mpath} has no 'tensors' table; delete the store and convert again")
    if manifest.get("format") != FORMAT_VERSION:
        raise WeightStoreError(f"{mpath} has format {manifest.get('format')!r}, this version reads "
                               f"{FORMAT_VERSION}; convert the weights again")
    return manifest


def open_store(path: str | os.PathLike, specs: Sequence[WeightSpec] | None = None) -> StoreReader:
    """Open a store and check it against `specs` (every spec present in the manifest with the same shape, its
    file present with the exact size, its values finite: module doc). Without specs, every manifest entry is
    checked against itself."""
    root = Path(path).expanduser()
    manifest = read_manifest(root)
    tensors = manifest["tensors"]
    offsets: dict[str, int] = {}
    scanned = False
    wanted = [(s.name, s.shape) for s in specs] if specs is not None else [
        (n, tuple(e["shape"])) for n, e in tensors.items()]
    for name, shape in wanted:
        entry = tensors.get(name)
        if entry is None:
            raise WeightStoreError(f"tensor {name!r} is missing from {root / MANIFEST} (the store was converted "
                                   f"for model {manifest.get('model')!r}); convert the weights again")
        fpath = root / entry.get("file", f"{name}.npy")
        if tuple(entry.get("shape", ())) != tuple(shape):
            raise WeightStoreError(f"{fpath}: manifest shape {entry.get('shape')} does not match the model's "
                                   f"{list(shape)} (store converted for {manifest.get('model')!r})")
        offsets[name] = check_npy(fpath, shape)
        scanned = _check_finite(fpath, entry, offsets[name], shape) or scanned
    if scanned:
        _save_manifest(root, manifest)
    return StoreReader(root, manifest, offsets)
