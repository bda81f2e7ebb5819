"""Conversion streams: peak RSS stays far below the checkpoint size.

A ~1.4 GB fp32 OPT-like checkpoint (width 2048, 7 layers, one safetensors shard per layer) is written piece by
piece from one reused random block, so making it costs no memory; the conversion runs in a subprocess that
reports its own peak RSS.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

from flexgen_h2o.models import all_specs, build_layers, resolve_model
from flexgen_h2o.weights import open_store

BLOCK = np.random.default_rng(0).normal(0, 0.02, 1 << 20).astype(np.float32)   # 4 MiB, tiled into tensors


def _write_shard(path, tensors: list[tuple[str, tuple[int, ...]]]) -> None:
    header, off = {}, 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, shape in tensors:
            left = int(np.prod(shape))
            while left:
                k = min(left, BLOCK.size)
                f.write(BLOCK[:k].tobytes())
                left -= k


def _checkpoint(folder, cfg) -> int:
    """Write the sharded checkpoint of `cfg` (one shard per layer); returns its size in bytes."""
    folder.mkdir()
    groups: dict[str, list] = {}
    for spec in all_specs(build_layers(cfg)):
        part = spec.name.split(".")[1] if spec.name.startswith("layers.") else "rest"
        groups.setdefault(part, []).append((spec.hf_name, spec.shape))
    weight_map = {}
    for i, (part, tensors) in enumerate(sorted(groups.items())):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        _write_shard(folder / fname, tensors)
        weight_map.update({name: fname for name, _ in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sum(os.path.getsize(p) for p in folder.iterdir())


# VmHWM (peak RSS of this address space) rather than ru_maxrss: ru_maxrss survives fork+exec, so a child of a
# big pytest process would report the parent's size
CHILD = """
import resource, sys
from flexgen_h2o.models import resolve_model
from flexgen_h2o.weights import convert_checkpoint
cfg = resolve_model("opt-1.3b").replace(name="wide", n_layers=7, vocab_size=1024, max_seq_len=126)
convert_checkpoint(sys.argv[1], cfg, sys.argv[2], progress=False)
try:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
    print(int(hwm.split()[1]) * 1024)
except OSError:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_conversion_peak_rss_below_half_checkpoint(tmp_path):
    cfg = resolve_model("opt-1.3b").replace(name="wide", n_layers=7, vocab_size=1024, max_seq_len=126)
    try:
        size = _checkpoint(tmp_path / "hf", cfg)
        assert size > 1.3e9
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "hf"), str(tmp_path / "store")],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        peak = int(proc.stdout.split()[-1])
        print(f"checkpoint {size / 1e9:.2f} GB, conversion peak RSS {peak / 1e9:.2f} GB")
        assert peak < 0.5 * size
        fc1 = open_store(tmp_path / "store", all_specs(build_layers(cfg))).read("layers.6.fc1.weight")
        want = np.resize(BLOCK, fc1.size).astype(np.float16).reshape(fc1.shape)
        np.testing.assert_array_equal(fc1, want)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)   # 2 GB: do not leave it in pytest's kept tmp dirs
