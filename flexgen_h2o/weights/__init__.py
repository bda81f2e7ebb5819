"""The weight store: fp16 `.npy` files plus a manifest, its converters (HF/GGUF/Hub), and dummy weights."""
from __future__ import annotations

from flexgen_h2o.weights.convert import config_from_source, convert_checkpoint
from flexgen_h2o.weights.dummy import DummyStore, dummy_tensor, iter_dummy_chunks, write_dummy_store
from flexgen_h2o.weights.embedded import EMBEDDED_MODEL, embedded_gguf_path, ensure_embedded_store
from flexgen_h2o.weights.hub import download_and_convert
from flexgen_h2o.weights.store import (FORMAT_VERSION, StoreReader, WeightStoreError, default_store_path,
                                       open_store, read_manifest, store_root)
from flexgen_h2o.weights.writer import StoreWriter

__all__ = ["config_from_source", "convert_checkpoint", "DummyStore", "dummy_tensor", "iter_dummy_chunks",
           "write_dummy_store", "EMBEDDED_MODEL", "embedded_gguf_path", "ensure_embedded_store",
           "download_and_convert", "FORMAT_VERSION", "StoreReader", "WeightStoreError", "default_store_path",
           "open_store", "read_manifest", "store_root", "StoreWriter"]
