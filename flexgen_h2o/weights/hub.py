"""Fetch a checkpoint from the Hugging Face Hub and convert it into a store.

Safetensors are fetched first; `.bin` shards only when a repo has no safetensors, so a repo holding both is
not downloaded twice. Any download failure (offline mode, no network, gated repo, unknown id) becomes one
`WeightStoreError` that says what to do instead; with HF_HUB_OFFLINE=1 huggingface_hub fails at once unless
the files are already in its cache, in which case the cached copy is converted.
"""
from __future__ import annotations

import os
from pathlib import Path

from flexgen_h2o.models import ModelConfig, ModelNameError, resolve_model
from flexgen_h2o.weights.convert import config_from_source, convert_checkpoint
from flexgen_h2o.weights.store import WeightStoreError, default_store_path

_COMMON = ["*.json", "tokenizer*"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _failure(hf_id: str, err: BaseException | str) -> WeightStoreError:
    if isinstance(err, BaseException):
        if _offline() and not isinstance(err, ImportError):
            err = "HF_HUB_OFFLINE is set and the files are not in the local Hugging Face cache"
        else:
            first = (str(err).strip().splitlines() or [""])[0].split(". ")[0]
            first = first if len(first) <= 200 else first[:197] + "..."
            err = f"{type(err).__name__}: {first}" if first else type(err).__name__
    return WeightStoreError(
        f"weights for {hf_id} are not converted and cannot be downloaded ({err}); convert a local checkpoint "
        "with `python -m flexgen_h2o.convert /path/to/hf_folder --model NAME` or use --dummy-weights")


def download(hf_id: str) -> Path:
    """Snapshot the files needed for conversion into the HF cache; returns the snapshot folder."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise _failure(hf_id, e) from None
    try:
        folder = Path(snapshot_download(hf_id, allow_patterns=_COMMON + ["*.safetensors"]))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(hf_id, allow_patterns=_COMMON + ["pytorch_model*.bin"]))
    except Exception as e:   # huggingface_hub raises HTTP, offline, auth and OS errors of many types
        raise _failure(hf_id, e) from None
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise _failure(hf_id, "the repo has no safetensors or pytorch_model*.bin files")
    return folder


def download_and_convert(hf_id: str, dest: str | os.PathLike | None = None, *, cfg: ModelConfig | None = None,
                         progress: bool = True) -> Path:
    """Download `hf_id` and convert it into a store at `dest` (default: the model's default store path).
    `cfg` defaults to the preset the id maps to, else the downloaded config.json."""
    if cfg is None:
        try:
            cfg = resolve_model(hf_id)
        except ModelNameError:
            cfg = None   # unknown id: read its config.json once downloaded
    folder = download(hf_id)
    if cfg is None:
        cfg = config_from_source(folder).replace(name=hf_id)
    dest = Path(dest).expanduser() if dest is not None else default_store_path(cfg)
    return convert_checkpoint(folder, cfg, dest, progress=progress)
