"""Model name -> (ModelConfig, weight reader, tokenizer): presets, HF ids, local folders, dummy weights.

Order of resolution: dummy weights (nothing on disk); an existing store at --path or the default location;
the embedded SmolLM2 (converted on first use); a local HF folder (converted on first use); the hub (machines
with network only; here it fails with a message that says how to convert a local checkpoint).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from flexgen_h2o.models import ModelConfig, all_specs, build_layers, resolve_model
from flexgen_h2o.weights import (DummyStore, EMBEDDED_MODEL, WeightStoreError, convert_checkpoint,
                                 default_store_path, download_and_convert, ensure_embedded_store, open_store,
                                 read_manifest, write_dummy_store)
from flexgen_h2o.weights.dummy import SOURCE


@dataclass
class LoadedModel:
    config: ModelConfig
    read: Callable[[str], np.ndarray]      # tensor name -> fp16 array (memmap for a store)
    tokenizer: Any | None                  # a transformers tokenizer, or None
    store_path: Path | None                # None for dummy weights
    locate: Callable | None = None         # a store's name -> (file, offset, bytes), for streamed disk reads


def load_tokenizer(store: Path | None) -> Any | None:
    folder = store / "tokenizer" if store is not None else None
    if folder is None or not folder.is_dir():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


def fallback_tokenizer() -> Any | None:
    """Dummy-weight runs still tokenize real text: borrow the embedded model's tokenizer when it is converted."""
    store = default_store_path(EMBEDDED_MODEL)
    return load_tokenizer(store) if (store / "manifest.json").is_file() else None


def _current_dummy(store: Path) -> bool:
    """A dummy store this version's generator wrote (an older one holds other values: written again)."""
    try:
        return read_manifest(store).get("source") == SOURCE.format(seed=0)
    except (OSError, ValueError, WeightStoreError):
        return False


def load_model(model: str, *, path: str | None = None, dummy_weights: bool = False, dummy_on_disk: bool = False,
               progress: bool = True) -> LoadedModel:
    """dummy_on_disk: materialise the dummy weights as a real store once (cached), so a disk placement
    streams real files instead of arrays generated in RAM."""
    cfg = resolve_model(model)
    specs = all_specs(build_layers(cfg))
    if dummy_weights and not dummy_on_disk:
        return LoadedModel(cfg, DummyStore(specs).read, fallback_tokenizer(), None)
    if dummy_weights:
        store = Path(path).expanduser() if path else default_store_path(cfg.name + "-dummy")
        if not _current_dummy(store):
            store = write_dummy_store(cfg, store, progress=progress)
        reader = open_store(store, specs)
        return LoadedModel(cfg, reader.read, fallback_tokenizer(), store, reader.locate)
    store = ensure_store(model, cfg, path=path, progress=progress)
    reader = open_store(store, specs)
    return LoadedModel(cfg, reader.read, load_tokenizer(store) or fallback_tokenizer(), store, reader.locate)


def ensure_store(model: str, cfg: ModelConfig | None = None, *, path: str | None = None,
                 progress: bool = True) -> Path:
    """The converted store of a real-weights model, converted on first use: the embedded SmolLM2 from its
    package, a local HF folder from its files, a hub id from the hub (where there is a network)."""
    cfg = cfg or resolve_model(model)
    store = Path(path).expanduser() if path else default_store_path(cfg)
    if (store / "manifest.json").is_file():
        return store
    if cfg.name == EMBEDDED_MODEL:
        return ensure_embedded_store(store, progress=progress)
    if os.path.isfile(os.path.join(os.path.expanduser(model), "config.json")):
        return convert_checkpoint(os.path.expanduser(model), cfg, store, progress=progress)
    return download_and_convert(cfg.hf_id or model, store, cfg=cfg, progress=progress)   # says how else
