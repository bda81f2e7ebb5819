"""A damaged store gives one WeightStoreError that names the file at fault, never a numpy traceback."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from flexgen_h2o.weights import WeightStoreError, default_store_path, open_store

Q = "layers.0.self_attn.q_proj.weight"


@pytest.fixture()
def store(llama_store, tmp_path):
    """A private copy of the session's converted tiny Llama store, free to damage."""
    src, cfg = llama_store
    dest = tmp_path / "store"
    shutil.copytree(src, dest)
    return dest, cfg


def test_reads_memmap_read_only(store, hf):
    path, cfg = store
    reader = open_store(path, hf.specs_of(cfg))
    arr = reader.read(Q)
    assert isinstance(arr, np.memmap) and arr.shape == (64, 64) and not arr.flags.writeable
    file, offset, nbytes = reader.locate(Q)
    assert file.name == Q + ".npy" and offset % 64 == 0 and nbytes == 64 * 64 * 2
    assert os.path.getsize(file) == offset + nbytes == reader.manifest["tensors"][Q]["bytes"]
    assert open_store(path).names == reader.names   # without specs: the manifest checked against itself


def test_truncated_file_names_it(store, hf):
    path, cfg = store
    f = path / f"{Q}.npy"
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) - 10)
    with pytest.raises(WeightStoreError, match=rf"{Q}\.npy is truncated"):
        open_store(path, hf.specs_of(cfg))
    with open(f, "r+b") as fh:   # cut inside the header too
        fh.truncate(20)
    with pytest.raises(WeightStoreError, match=rf"{Q}\.npy is not a valid \.npy"):
        open_store(path, hf.specs_of(cfg))


def test_oversized_file_names_it(store, hf):
    path, cfg = store
    with open(path / f"{Q}.npy", "ab") as fh:
        fh.write(b"\0" * 4)
    with pytest.raises(WeightStoreError, match=rf"{Q}\.npy is larger than expected"):
        open_store(path, hf.specs_of(cfg))


def test_missing_file_names_it(store, hf):
    path, cfg = store
    (path / f"{Q}.npy").unlink()
    with pytest.raises(WeightStoreError, match=rf"missing: .*{Q}\.npy"):
        open_store(path, hf.specs_of(cfg))


def test_missing_manifest(store, hf):
    path, cfg = store
    (path / "manifest.json").unlink()
    with pytest.raises(WeightStoreError, match=r"manifest\.json is missing.*flexgen_h2o\.convert"):
        open_store(path, hf.specs_of(cfg))


def test_tensor_missing_from_manifest(store, hf):
    path, cfg = store
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["tensors"][Q]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(WeightStoreError, match=rf"{Q}.*missing from .*manifest\.json"):
        open_store(path, hf.specs_of(cfg))


def test_shape_mismatch_against_specs(store, hf):
    path, cfg = store
    with pytest.raises(WeightStoreError, match=r"gate_proj\.weight\.npy: manifest shape \[128, 64\].*\[96, 64\]"):
        open_store(path, hf.specs_of(cfg.replace(ffn_size=96)))


def test_file_shape_differs_from_manifest(store, hf):
    path, cfg = store
    np.save(path / f"{Q}.npy", np.zeros((32, 128), np.float16))   # same byte count, wrong shape
    with pytest.raises(WeightStoreError, match=rf"{Q}\.npy has shape \[32, 128\], expected \[64, 64\]"):
        open_store(path, hf.specs_of(cfg))


def test_default_store_path(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEXGEN_H2O_HOME", str(tmp_path))
    assert default_store_path("opt-125m") == tmp_path / "opt-125m"
    assert default_store_path("org/Model-X") == tmp_path / "org--Model-X"
    folder = tmp_path / "my model"
    folder.mkdir()
    a, b = default_store_path(str(folder)), default_store_path(str(tmp_path / "x" / "my model"))
    assert a.parent == tmp_path and a.name.startswith("my-model-") and a != b
