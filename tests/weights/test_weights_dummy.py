"""Dummy weights: deterministic per (name, seed), N(0, 0.02) matrices, ones/zeros only for norms and biases."""
from __future__ import annotations

import numpy as np

from flexgen_h2o.models import WeightSpec
from flexgen_h2o.weights import DummyStore, dummy_tensor, iter_dummy_chunks, open_store, write_dummy_store


def _spec(name: str, shape=(256, 128), init: str = "normal") -> WeightSpec:
    return WeightSpec(key=name, name=name, shape=shape, hf_name="model." + name, init=init)


def test_deterministic_and_distinct():
    a, b = dummy_tensor(_spec("layers.0.fc1.weight")), dummy_tensor(_spec("layers.0.fc1.weight"))
    assert a.dtype == np.float16 and a.shape == (256, 128)
    assert a.tobytes() == b.tobytes()
    assert a.tobytes() != dummy_tensor(_spec("layers.1.fc1.weight")).tobytes()
    assert a.tobytes() != dummy_tensor(_spec("layers.0.fc1.weight"), seed=1).tobytes()


def test_scale_and_inits():
    w = dummy_tensor(_spec("w", (512, 512))).astype(np.float32)
    assert abs(w.std() - 0.02) < 0.001 and abs(w.mean()) < 0.001
    assert not np.all(w == 1) and len(np.unique(w)) > 1000
    assert np.all(dummy_tensor(_spec("n.weight", (64,), "ones")) == 1)
    assert np.all(dummy_tensor(_spec("n.bias", (64,), "zeros")) == 0)


def test_chunking_does_not_change_values():
    spec = _spec("big", (100, 77))
    parts = np.concatenate(list(iter_dummy_chunks(spec, chunk=333)))
    assert parts.tobytes() == dummy_tensor(spec).tobytes()


def test_write_dummy_store_matches_lazy(tmp_path, hf):
    cfg = hf.cfg_of(hf.tiny_llama())
    specs = hf.specs_of(cfg)
    store = write_dummy_store(cfg, tmp_path / "dummy", progress=False)
    reader, lazy = open_store(store, specs), DummyStore(specs)
    for spec in specs:
        assert reader.read(spec.name).tobytes() == lazy.read(spec.name).tobytes(), spec.name
    assert reader.manifest["source"] == "dummy-pool-v2(seed=0)"
    assert [p.name for p in tmp_path.iterdir()] == ["dummy"]


def test_rows_never_repeat_and_chunks_cross_rows():
    """A row is a window of the shared pool at its own start: no two rows of a tensor are the same, even for more
    rows than the pool has windows of that width, and a chunk boundary inside a row changes nothing."""
    spec = _spec("layers.0.fc2.weight", (4096, 64))
    w = dummy_tensor(spec)
    assert len({row.tobytes() for row in w}) == len(w)
    assert np.concatenate(list(iter_dummy_chunks(spec, chunk=1000))).tobytes() == w.tobytes()
    assert abs(w.astype(np.float32).std() - 0.02) < 0.001


def test_a_dummy_store_from_an_older_generator_is_written_again(tmp_path, monkeypatch, hf):
    """Stores cached by an older generator hold other values than DummyStore gives: the loader rewrites them, so
    weights on disk and in RAM stay the same tensors."""
    import json

    import flexgen_h2o.loader as loader
    cfg = hf.cfg_of(hf.tiny_llama())
    monkeypatch.setattr(loader, "resolve_model", lambda name: cfg)
    store = write_dummy_store(cfg, tmp_path / "dummy", progress=False)
    manifest = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**manifest, "source": "dummy(seed=0)"}))
    name = next(s.name for s in hf.specs_of(cfg) if s.init == "normal")
    path = store / f"{name}.npy"
    arr = np.load(path, mmap_mode="r+")
    arr[...] = 0
    arr.flush()
    del arr
    loaded = loader.load_model("tiny", path=str(store), dummy_weights=True, dummy_on_disk=True, progress=False)
    assert loaded.read(name).tobytes() == DummyStore(hf.specs_of(cfg)).read(name).tobytes()
    assert json.loads((store / "manifest.json").read_text())["source"] == "dummy-pool-v2(seed=0)"
