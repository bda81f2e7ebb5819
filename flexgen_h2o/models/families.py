"""Model families by name: how a family builds its layer list and reads an HF config.json. A new family (say a
Llama-like one with its own weight names) is its module, with a build function and a config reader, plus one
Family line below; presets name their family, and config.json files are matched by model_type or architecture.
"""
from __future__ import annotations

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


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("opt", "OPT", build_opt_layers, opt_from_hf, ("opt",)),
    Family("llama", "Llama-like", build_llama_layers, llama_from_hf, ("llama", "mistral"), ("LlamaForCausalLM",)),
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
