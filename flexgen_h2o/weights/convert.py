"""Convert an HF checkpoint (safetensors, `.bin` shards or GGUF) into a weight store, tensor by tensor.

Tensors are matched to the model's `WeightSpec`s by `spec.hf_name`; extra checkpoint tensors (rotary
`inv_freq`, a tied `lm_head.weight`) are ignored, a missing or mis-shaped needed tensor is an error naming it.
Each tensor is read, cast to fp16, written and dropped before the next, so memory stays near one tensor.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from flexgen_h2o.models import ModelConfig, ModelNameError, all_specs, build_layers, from_hf_config, resolve_model
from flexgen_h2o.models.config import CheckpointConfigError
from flexgen_h2o.weights.sources import open_checkpoint, require_gguf
from flexgen_h2o.weights.store import WeightStoreError, default_store_path
from flexgen_h2o.weights.writer import StoreWriter

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _gguf_file(src: Path) -> Path | None:
    if src.is_file() and src.suffix.lower() == ".gguf":
        return src
    if src.is_dir() and not any(src.glob("*.safetensors")) and not any(src.glob("pytorch_model*.bin")):
        ggufs = sorted(src.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def config_from_source(src: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint folder (its config.json) or GGUF file (its metadata)."""
    src = Path(src).expanduser()
    gguf = _gguf_file(src)
    try:
        if gguf is not None:
            require_gguf()
            from transformers import AutoConfig
            hf = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
            return from_hf_config(hf, name=str(src))
        return resolve_model(str(src))
    except CheckpointConfigError as e:
        if gguf is None:     # config.json: the message names the file, the field and the fix already
            raise
        raise WeightStoreError(f"cannot tell the model of {src}: {e}; pass --model NAME") from None
    except ModelNameError as e:
        raise WeightStoreError(f"cannot tell the model of {src}: {e}; pass --model NAME") from None
    except WeightStoreError:
        raise
    except Exception as e:   # transformers config parsing raises many kinds
        raise WeightStoreError(f"cannot read the model config of {src}: {e}; pass --model NAME") from None


def _hf_candidates(hf_name: str) -> list[str]:
    # some checkpoints were saved from the bare base model, without the "model." prefix (and vice versa)
    alt = hf_name[len("model."):] if hf_name.startswith("model.") else "model." + hf_name
    return [hf_name, alt]


def _copy_tokenizer(src: Path, out: Path) -> None:
    """Save the source's tokenizer into `out`; a failure warns, since the weights alone are still usable."""
    gguf = _gguf_file(src)
    folder = src if src.is_dir() else src.parent
    if gguf is None and not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return
    try:
        from transformers import AutoTokenizer
        kwargs = {"gguf_file": gguf.name} if gguf is not None else {}
        tok = AutoTokenizer.from_pretrained(str(gguf.parent if gguf else folder), **kwargs)
        tok.save_pretrained(str(out))
    except Exception as e:   # tokenizer loading fails in many ways; weights stay valid without it
        warnings.warn(f"could not copy the tokenizer from {src}: {e}", stacklevel=3)


def convert_checkpoint(src: str | os.PathLike, cfg: ModelConfig | None = None,
                       dest: str | os.PathLike | None = None, *, progress: bool = True) -> Path:
    """Convert `src` (HF folder, single .safetensors/.bin file or .gguf file) into a store at `dest`
    (default `default_store_path(cfg)`); `cfg` defaults to the source's own config. Returns the store path.
    The store appears at `dest` only once complete; on any error nothing is left behind."""
    src = Path(src).expanduser()
    if not src.exists():
        raise WeightStoreError(f"checkpoint not found: {src}")
    cfg = cfg or config_from_source(src)
    dest = Path(dest).expanduser() if dest is not None else default_store_path(cfg)
    specs = all_specs(build_layers(cfg))
    ckpt = open_checkpoint(src)

    plan: dict[str, list[tuple]] = {}   # shard -> [(spec, checkpoint key)], so each shard is opened once
    missing = []
    for spec in specs:
        key = next((k for k in _hf_candidates(spec.hf_name) if k in ckpt.keys), None)
        if key is None:
            missing.append(spec.hf_name)
        else:
            plan.setdefault(ckpt.keys[key], []).append((spec, key))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightStoreError(f"{src}: checkpoint has no tensor {missing[0]!r}{more} needed by model {cfg.name} "
                               f"({cfg.family}, {cfg.n_layers} layers); is --model right?")

    with StoreWriter(dest, cfg, source=str(src)) as writer:
        with tqdm(total=len(specs), desc=f"convert {cfg.name}", unit="tensor", disable=not progress) as bar:
            for shard in sorted(plan):
                with ckpt.open_shard(shard) as get:
                    for spec, key in plan[shard]:
                        t = get(key)
                        if tuple(t.shape) != tuple(spec.shape):
                            raise WeightStoreError(f"{src}: tensor {key!r} has shape {list(t.shape)}, model "
                                                   f"{cfg.name} expects {list(spec.shape)}; is --model right?")
                        t16 = t.to(torch.float16)
                        if t.is_floating_point() and not bool(torch.isfinite(t16).all()):
                            # a NaN weight runs and answers garbage with exit 0: refuse it here, by name
                            if bool(torch.isfinite(t).all()):
                                raise WeightStoreError(f"{src}: tensor {key!r} overflows float16")
                            bad = int((~torch.isfinite(t)).sum())
                            raise WeightStoreError(f"{src}: tensor {key!r} holds {bad} NaN or infinite value(s) "
                                                   f"of {t.numel()}; the checkpoint is damaged: get a good copy "
                                                   "and convert again")
                        writer.write(spec.name, t16)
                        del t, t16
                        bar.update()
        _copy_tokenizer(src, writer.tokenizer_dir)
        return writer.commit()
