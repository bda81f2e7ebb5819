"""Checkpoint readers that hand out one tensor at a time: safetensors, PyTorch `.bin` shards, GGUF.

Each reader maps HF tensor names to shards and opens one shard at a time. Safetensors files are read with
plain `readinto` from their (documented) header offsets rather than `safe_open`: safe_open maps the whole
file, and every page it touched stays in the process RSS until the file is closed, so peak RSS grew to the
shard size. Reading into a fresh buffer keeps peak memory at about one tensor. `.bin` shards are mapped with
`torch.load(mmap=True)` (pages are clean and reclaimable, but count as RSS up to one shard). GGUF goes through
transformers, which dequantizes the whole model in memory (fine for the small GGUF models this is used for).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import struct
from pathlib import Path
from typing import Callable, Iterator

import torch

from flexgen_h2o.weights.store import WeightStoreError

Getter = Callable[[str], torch.Tensor]

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class Checkpoint:
    """`keys` maps every HF tensor name to the shard holding it; `open_shard(shard)` yields a getter."""

    def __init__(self, label: str, keys: dict[str, str]):
        self.label = label
        self.keys = keys

    def open_shard(self, shard: str) -> contextlib.AbstractContextManager[Getter]:
        raise NotImplementedError


# --- safetensors ---

def _st_header(path: Path) -> tuple[int, dict]:
    """(data start offset, tensor table) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            n = struct.unpack("<Q", raw)[0]
            if n > 1 << 30:
                raise ValueError(f"header length {n} is not plausible")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise WeightStoreError(f"{path} is not a readable safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return 8 + n, header


def _read_exact(f, buf: memoryview, path: Path, name: str) -> None:
    got = 0
    while got < len(buf):
        n = f.readinto(buf[got:])
        if not n:
            raise WeightStoreError(f"{path} is truncated: tensor {name!r} ends past the end of the file")
        got += n


class SafetensorsCheckpoint(Checkpoint):
    def __init__(self, files: list[Path], weight_map: dict[str, str] | None, label: str):
        self.files = {f.name: f for f in files}
        self._headers: dict[str, tuple[int, dict]] = {}
        if weight_map is None:   # no index: the headers themselves say which file holds what
            weight_map = {k: f.name for f in files for k in self._header(f.name)[1]}
        super().__init__(label, weight_map)

    def _header(self, shard: str) -> tuple[int, dict]:
        if shard not in self._headers:
            path = self.files.get(shard)
            if path is None or not path.is_file():
                raise WeightStoreError(f"{self.label}: shard file {shard} named by the index is missing")
            self._headers[shard] = _st_header(path)
        return self._headers[shard]

    @contextlib.contextmanager
    def open_shard(self, shard: str) -> Iterator[Getter]:
        base, table = self._header(shard)
        path = self.files[shard]
        with open(path, "rb", buffering=0) as f:
            def get(name: str) -> torch.Tensor:
                info = table.get(name)
                if info is None:
                    raise WeightStoreError(f"{path}: the index puts tensor {name!r} here but the file lacks it")
                dtype = _ST_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise WeightStoreError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
                t = torch.empty(info["shape"], dtype=dtype)
                start, end = info["data_offsets"]
                if end - start != t.numel() * t.element_size():
                    raise WeightStoreError(f"{path}: tensor {name!r} byte range does not match its shape")
                if t.numel():
                    f.seek(base + start)
                    _read_exact(f, memoryview(t.view(-1).view(torch.uint8).numpy()), path, name)
                return t
            yield get


# --- PyTorch .bin ---

def _torch_load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise WeightStoreError(f"cannot load {path}: {e}") from None
        # legacy (pre-zip) pickles cannot be mapped; they load whole, one shard at a time
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:   # unpickling errors come in many types
        raise WeightStoreError(f"cannot load {path}: {e}") from None


class BinCheckpoint(Checkpoint):
    def __init__(self, files: list[Path], weight_map: dict[str, str] | None, label: str):
        self.files = {f.name: f for f in files}
        if weight_map is None:
            weight_map = {}
            for f in files:
                sd = _torch_load(f)
                weight_map.update({k: f.name for k in sd})
                del sd
        super().__init__(label, weight_map)

    @contextlib.contextmanager
    def open_shard(self, shard: str) -> Iterator[Getter]:
        path = self.files.get(shard)
        if path is None or not path.is_file():
            raise WeightStoreError(f"{self.label}: shard file {shard} named by the index is missing")
        sd = _torch_load(path)
        try:
            yield lambda name: sd[name]
        finally:
            sd.clear()   # drop the mapping before the next shard opens


# --- GGUF ---

def require_gguf() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise WeightStoreError(f"reading GGUF needs the {' and '.join(missing)} package(s): "
                               "pip install gguf accelerate")


class GGUFCheckpoint(Checkpoint):
    def __init__(self, path: Path):
        require_gguf()
        from transformers import AutoModelForCausalLM
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32)
        except Exception as e:   # transformers raises many kinds for an unreadable or unsupported GGUF
            raise WeightStoreError(f"cannot load GGUF file {path}: {e}") from None
        self._sd = model.state_dict()
        del model
        super().__init__(str(path), {k: path.name for k in self._sd})

    @contextlib.contextmanager
    def open_shard(self, shard: str) -> Iterator[Getter]:
        try:
            yield lambda name: self._sd[name]
        finally:
            self._sd = {}


# --- detection ---

def _index(path: Path) -> dict[str, str]:
    try:
        return dict(json.loads(path.read_text())["weight_map"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightStoreError(f"{path} is not a valid shard index: {e}") from None


def open_checkpoint(src: Path) -> Checkpoint:
    """Detect the checkpoint kind of a file or folder."""
    if src.is_file():
        suffix = src.suffix.lower()
        if suffix == ".gguf":
            return GGUFCheckpoint(src)
        if suffix == ".safetensors":
            return SafetensorsCheckpoint([src], None, str(src))
        if suffix in (".bin", ".pt", ".pth"):
            return BinCheckpoint([src], None, str(src))
        raise WeightStoreError(f"{src}: unknown checkpoint file type (expected .safetensors, .bin or .gguf)")
    if not src.is_dir():
        raise WeightStoreError(f"checkpoint not found: {src}")
    index = src / "model.safetensors.index.json"
    if index.is_file():
        wm = _index(index)
        return SafetensorsCheckpoint([src / f for f in sorted(set(wm.values()))], wm, str(src))
    st = sorted(src.glob("*.safetensors"))
    if st:
        return SafetensorsCheckpoint(st, None, str(src))
    index = src / "pytorch_model.bin.index.json"
    if index.is_file():
        wm = _index(index)
        return BinCheckpoint([src / f for f in sorted(set(wm.values()))], wm, str(src))
    bins = sorted(src.glob("pytorch_model*.bin"))
    if bins:
        return BinCheckpoint(bins, None, str(src))
    ggufs = sorted(src.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFCheckpoint(ggufs[0])
    raise WeightStoreError(f"no checkpoint in {src}: expected model.safetensors, model.safetensors.index.json, "
                           "pytorch_model*.bin or one .gguf file")
