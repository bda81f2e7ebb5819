"""Compressed weights (--compress-weight): the matrices of a model in a group-wise int4/int8 format, converted once.

Which tensors: every weight matrix that a layer multiplies (projections, MLP, an untied output head). Embedding
tables are read by row and stay fp16, and so does a head tied to the token embedding (it is that table); norms and
biases stay in the store's fp16. A stored matrix (n, k) becomes uint8 rows (n, row_width(k)), groups taken along
k, the input dimension each output sums over (quant.py's row form, what kernels/csrc/quant_linear.cpp reads).

Where they live: beside the fp16 store, in `<store>/<format name>/` (e.g. `int4-g64/`): one `.npy` per matrix and
a manifest written last; the folder is written under a temporary name and renamed into place whole, so a killed
conversion leaves nothing a reader would take, and the next one removes its leftovers. Disk-homed matrices are
read from those files, so the disk and the link carry the compressed bytes. Dummy weights (no store) are
quantized in memory when the engine starts.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from flexgen_h2o.formats import StorageFormat
from flexgen_h2o.memory import release_free_heap
from flexgen_h2o.weights.placement import packed_names

MANIFEST = "manifest.json"
Read = Callable[[str], np.ndarray]
Locate = Callable[[str], tuple[Path, int, int]]


def store_folder(locate: Locate | None) -> Path | None:
    """The fp16 store behind a StoreReader's bound `locate` (None for dummy weights, which have no store)."""
    reader = getattr(locate, "__self__", None)
    path = getattr(reader, "path", None)
    return Path(path) if path is not None else None


def pack_matrix(array: np.ndarray, fmt: StorageFormat) -> np.ndarray:
    """An fp16 matrix (n, k) as its packed uint8 rows (n, row_width(k)), quantized in fp32 a block at a time."""
    n, k = array.shape
    out = np.empty((n, fmt.row_width(k)), dtype=np.uint8)
    step = max(1, (64 << 20) // (4 * k))               # 64 MB of fp32 at a time
    for lo in range(0, n, step):
        block = torch.from_numpy(np.array(array[lo:lo + step], dtype=np.float32))   # a copy: the store is read-only
        out[lo:lo + step] = fmt.pack(block).numpy()
    return out


def _remove_leftovers(parent: Path, name: str) -> None:
    """Temporary folders of conversions whose process is gone (killed): `<name>.tmp-<pid>-<hex>`."""
    for tmp in parent.glob(f"{name}.tmp-*"):
        try:
            pid = int(tmp.name.split(".tmp-", 1)[1].split("-", 1)[0])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass                                        # another user's live process


def convert(folder: Path, read: Read, shapes: dict[str, tuple[int, ...]], fmt: StorageFormat,
            progress: bool = True) -> None:
    """Write the packed matrices into `folder` (atomically: a temporary sibling renamed into place)."""
    tmp = folder.parent / f"{folder.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    try:
        names = sorted(shapes)
        for name in tqdm(names, desc=f"compressing weights to {fmt.name}", unit="matrix",
                         disable=None if progress else True):
            np.save(tmp / f"{name}.npy", pack_matrix(read(name), fmt))
        (tmp / MANIFEST).write_text(json.dumps({"format": fmt.name, "tensors": {
            n: {"shape": list(shapes[n]), "rows": [shapes[n][0], fmt.row_width(shapes[n][1])]} for n in names}}))
        try:
            os.replace(tmp, folder)
        except OSError:
            if not _complete(folder, shapes, fmt):   # another process converted it first: theirs is kept
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _complete(folder: Path, shapes: dict[str, tuple[int, ...]], fmt: StorageFormat) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    tensors = manifest.get("tensors", {})
    return manifest.get("format") == fmt.name and all(
        tensors.get(n, {}).get("shape") == list(s) and (folder / f"{n}.npy").is_file() for n, s in shapes.items())


def compressed_weights(layers: list, read: Read, locate: Locate | None, fmt: StorageFormat,
                       progress: bool = True) -> tuple[Read, Locate | None, set[str]]:
    """(read, locate, packed names) with every packed matrix in `fmt`. A store's matrices come from its
    `<fmt.name>/` folder (converted now if missing or stale); dummy weights are packed in memory as they are placed."""
    packed = packed_names(layers)
    shapes = {s.name: tuple(s.shape) for layer in layers for s in layer.weight_specs() if s.name in packed}
    store = store_folder(locate)
    if store is None:
        # packed when placed and not kept here: the placement holds the only copy (a cache here held every
        # matrix twice, which the planner does not count)
        def read_packed(name: str) -> np.ndarray:
            if name not in packed:
                return read(name)
            out = pack_matrix(read(name), fmt)
            release_free_heap()       # the packing's freed blocks would pile up in the heap until placement ends
            return out
        return read_packed, locate, packed
    folder = store / fmt.name
    _remove_leftovers(folder.parent, folder.name)
    if not _complete(folder, shapes, fmt):
        shutil.rmtree(folder, ignore_errors=True)
        convert(folder, read, shapes, fmt, progress)

    def read_stored(name: str) -> np.ndarray:
        return np.load(folder / f"{name}.npy", mmap_mode="r") if name in packed else read(name)

    def locate_stored(name: str) -> tuple[Path, int, int]:
        if name not in packed:
            return locate(name)
        path = folder / f"{name}.npy"
        with open(path, "rb") as f:
            np.lib.format.read_magic(f)
            shape, _, _ = np.lib.format.read_array_header_1_0(f)
            offset = f.tell()
        return path, offset, int(np.prod(shape))
    return read_stored, locate_stored, packed
