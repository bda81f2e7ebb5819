"""Weights with NaN or infinite values are refused, by file or tensor name: at conversion, and at open when a file
changed after it (the manifest's per-tensor flag and mtime); a store from before the flag is scanned once."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from flexgen_h2o.weights import WeightStoreError, convert_checkpoint, open_store
from flexgen_h2o.weights import store as store_mod

Q = "layers.0.self_attn.q_proj.weight"


@pytest.fixture()
def store(llama_store, tmp_path):
    src, cfg = llama_store
    dest = tmp_path / "store"
    shutil.copytree(src, dest)                 # copy2 keeps the files' mtimes: the flags still hold
    return dest, cfg


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _poison(file, value=np.nan) -> None:
    """Overwrite the data of a tensor file in place, as a tool or a bad copy would."""
    data = np.load(file, mmap_mode="r+")
    data[...] = value
    data.flush()
    del data


def test_conversion_records_a_finite_flag_and_an_open_trusts_it(store, hf, monkeypatch):
    path, cfg = store
    entry = _manifest(path)["tensors"][Q]
    assert entry["finite"] is True and entry["mtime_ns"] == os.stat(path / f"{Q}.npy").st_mtime_ns
    scans = []
    monkeypatch.setattr(store_mod, "count_nonfinite", lambda *a: scans.append(a) or 0)
    open_store(path, hf.specs_of(cfg))
    assert scans == []                         # a run does not rescan a store whose files are as written


def test_a_file_changed_after_conversion_is_scanned_and_refused(store, hf):
    path, cfg = store
    file = path / f"{Q}.npy"
    _poison(file)
    os.utime(file, ns=(os.stat(file).st_atime_ns, os.stat(file).st_mtime_ns + 10**9))   # a coarse clock
    with pytest.raises(WeightStoreError) as e:
        open_store(path, hf.specs_of(cfg))
    assert str(e.value) == (f"weight store file {file} holds 4096 NaN or infinite value(s) of 4096 (it changed "
                            "after conversion); delete the store and convert again")


def test_a_store_from_before_the_flag_is_scanned_once_and_the_flags_recorded(store, hf, monkeypatch):
    path, cfg = store
    manifest = _manifest(path)
    for entry in manifest["tensors"].values():
        del entry["finite"], entry["mtime_ns"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    real = store_mod.count_nonfinite
    scans = []
    monkeypatch.setattr(store_mod, "count_nonfinite", lambda *a: scans.append(a) or real(*a))
    open_store(path, hf.specs_of(cfg))
    assert len(scans) == len(hf.specs_of(cfg))
    assert all(e["finite"] is True for e in _manifest(path)["tensors"].values())
    open_store(path, hf.specs_of(cfg))
    assert len(scans) == len(hf.specs_of(cfg))          # the second open trusts what the first recorded
    # an old store with a NaN file is caught by that first scan
    for entry in manifest["tensors"].values():
        entry.pop("finite", None), entry.pop("mtime_ns", None)
    (path / "manifest.json").write_text(json.dumps(manifest))
    _poison(path / f"{Q}.npy", np.inf)
    with pytest.raises(WeightStoreError, match=f"{Q}.npy holds 4096 NaN or infinite value\\(s\\) of 4096; delete"):
        open_store(path, hf.specs_of(cfg))


def test_a_checkpoint_with_nan_is_refused_at_conversion_by_tensor_name(tmp_path, hf):
    model = hf.tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "hf")
    with pytest.raises(WeightStoreError) as e:
        convert_checkpoint(tmp_path / "hf", hf.cfg_of(model), tmp_path / "store", progress=False)
    assert str(e.value) == (f"{tmp_path / 'hf'}: tensor 'model.layers.1.mlp.up_proj.weight' holds 1 NaN or infinite "
                            "value(s) of 8192; the checkpoint is damaged: get a good copy and convert again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]            # no store, no temporary folder
