"""Model families by name: how a family builds its layer list and reads an HF config.json; and the two ways to a
ModelConfig that need them: a config.json (from_hf_config) and a model name (resolve_model).

A new Llama-like family (Llama's tensor names, its own config.json quirks) is one `llama_like` line below, its
presets (models/config.py) and its case in tests/test_families.py; a family with other tensor names is its own
module with a build function and a config reader, as OPT is. Presets name their family, and config.json files
are matched by model_type, else by architecture.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from flexgen_h2o.models.config import (HF_ID_TO_PRESET, PRESETS, CheckpointConfigError, HFFields, ModelConfig,
                                       ModelNameError)
from flexgen_h2o.models.llama import build_llama_layers, llama_from_hf
from flexgen_h2o.models.opt import build_opt_layers, opt_from_hf


@dataclass(frozen=True)
class Family:
    name: str                                            # ModelConfig.family
    label: str                                           # what messages call it
    build_layers: Callable[[ModelConfig], list]          # embed, attn.0, mlp.0, ..., head
    from_hf: Callable[[HFFields, dict[str, Any]], ModelConfig]
    hf_model_types: tuple[str, ...]                      # config.json model_type values it reads
    hf_architectures: tuple[str, ...] = ()               # or, whatever the model_type, these architectures


def llama_like(name: str, label: str, model_types: tuple[str, ...], architectures: tuple[str, ...] = (),
               **reader: Any) -> Family:
    """A family with Llama's layers and tensor names; `reader`: llama_from_hf's switches for its config.json
    (qkv_bias, windowed)."""
    return Family(name, label, build_llama_layers, functools.partial(llama_from_hf, family=name, **reader),
                  model_types, architectures)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("opt", "OPT", build_opt_layers, opt_from_hf, ("opt",)),
    llama_like("llama", "Llama-like", ("llama",), ("LlamaForCausalLM",)),
    # q/k/v biases, no o_proj bias; a sliding window only where use_sliding_window is on (never in the releases)
    llama_like("qwen2", "Qwen2", ("qwen2",), ("Qwen2ForCausalLM",), qkv_bias=True, windowed=True),
    # every layer attends over `sliding_window` tokens (4096 in v0.1, none from v0.2 on)
    llama_like("mistral", "Mistral", ("mistral",), ("MistralForCausalLM",), windowed=True),
)}


def family_of(cfg: ModelConfig) -> Family:
    try:
        return FAMILIES[cfg.family]
    except KeyError:
        raise ValueError(f"model family {cfg.family!r} is not registered; known: {', '.join(FAMILIES)}") from None


def family_for_hf(hf: dict[str, Any]) -> Family | None:
    """The family that reads this config.json: by its model_type, else by its architectures."""
    model_type = hf.get("model_type") or ""
    archs = hf.get("architectures") or []
    archs = archs if isinstance(archs, list) else []
    for fam in FAMILIES.values():
        if model_type in fam.hf_model_types:
            return fam
    for fam in FAMILIES.values():
        if any(a in fam.hf_architectures for a in archs):
            return fam
    return None


def _listing(items: list[str], last: str) -> str:
    """'a, b or c'."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def from_hf_config(hf: dict[str, Any], name: str = "custom", source: str | None = None) -> ModelConfig:
    """Map an HF config dict to a ModelConfig, by the registered family that reads it.
    `source` (the config.json path) is what error messages name; a bad field raises CheckpointConfigError."""
    where = source or name
    if not isinstance(hf, dict):
        raise CheckpointConfigError(f"{where}: expected a JSON object of model settings, got {type(hf).__name__}; "
                                    "use the config.json saved with the checkpoint")
    model_type = hf.get("model_type") or ""
    family = family_for_hf(hf)
    known = _listing([json.dumps(t) for fam in FAMILIES.values() for t in fam.hf_model_types], "or")
    runs = f"flexgen_h2o runs {_listing([fam.label for fam in FAMILIES.values()], 'and')} models"
    if not model_type and family is None:
        raise CheckpointConfigError(f"{where}: field \"model_type\" is missing; set it to {known} ({runs})")
    if family is None:
        raise CheckpointConfigError(f"{where}: model_type {json.dumps(model_type)} is not supported; {runs} "
                                    f"(model_type {known})")
    f = HFFields(hf, where, model_type or family.name)
    hidden, heads = f.int("hidden_size"), f.int("num_attention_heads")
    head_dim = f.int("head_dim", None)
    if head_dim is None and hidden % heads:
        raise CheckpointConfigError(f"{where}: \"hidden_size\" ({hidden}) is not a multiple of "
                                    f"\"num_attention_heads\" ({heads}); fix one of them, or add \"head_dim\"")
    common = dict(name=name, n_layers=f.int("num_hidden_layers"), hidden_size=hidden, n_heads=heads,
                  head_dim=head_dim or hidden // heads, vocab_size=f.int("vocab_size"),
                  max_seq_len=f.int("max_position_embeddings", 2048))
    return family.from_hf(f, common)


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's config.json as a dict; unreadable or malformed files raise CheckpointConfigError."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as e:
        raise CheckpointConfigError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); fix it "
                                    "or copy it again from the original checkpoint") from None
    except UnicodeDecodeError:
        raise CheckpointConfigError(f"{path} is not UTF-8 text; copy it again from the original checkpoint") from None
    except OSError as e:
        raise CheckpointConfigError(f"cannot read {path}: {e.strerror or e}") from None


def resolve_model(spec: str) -> ModelConfig:
    """A preset name (`opt-30b`), an HF id (`facebook/opt-30b`) or a local folder with config.json."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.lower() in HF_ID_TO_PRESET:
        return PRESETS[HF_ID_TO_PRESET[spec.lower()]]
    cfg_path = os.path.join(os.path.expanduser(spec), "config.json")
    if os.path.isfile(cfg_path):
        return from_hf_config(read_hf_config(cfg_path), name=spec, source=cfg_path)
    raise ModelNameError(f"unknown model {spec!r}: use a preset ({', '.join(sorted(PRESETS))}), one of their HF ids, "
                         "or a local checkpoint folder with a config.json")
