"""Model math: configs, the layer protocol, the OPT and Llama layer lists, and the family registry."""
from __future__ import annotations

from flexgen_h2o.models.config import PRESETS, ModelConfig, ModelNameError
from flexgen_h2o.models.layer import KVSpec, KVView, Layer, LayerOutput, StepContext, WeightSpec
from flexgen_h2o.models.families import FAMILIES, Family, family_of, from_hf_config, resolve_model
from flexgen_h2o.models.llama import build_llama_layers
from flexgen_h2o.models.opt import build_opt_layers
from flexgen_h2o.models.transformer import all_specs, schedule_groups


def build_layers(cfg: ModelConfig) -> list:
    """The flat layer list: embed, attn.0, mlp.0, ..., attn.{L-1}, mlp.{L-1}, head."""
    return family_of(cfg).build_layers(cfg)


__all__ = ["PRESETS", "ModelConfig", "ModelNameError", "from_hf_config", "resolve_model", "KVSpec", "KVView",
           "Layer", "LayerOutput", "StepContext", "WeightSpec", "build_layers", "all_specs",
           "schedule_groups", "FAMILIES", "Family", "family_of", "build_llama_layers", "build_opt_layers"]
