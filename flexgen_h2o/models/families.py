"""Model families by name: how a family builds its layer list and reads an HF config.json.

A new Llama-like family (Llama's tensor names, its own config.json quirks) is one `llama_like` line below, its
presets (models/config.py) and its case in tests/test_families.py; a family with other tensor names is its own
module with a build function and a config reader, as OPT is. Presets name their family, and config.json files
are matched by model_type, else by architecture.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from flexgen_h2o.models.config import HFFields, ModelConfig
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
