"""The model family registry (models/families.py): presets and config.json files find their family there, and a
new Llama-like family is one Family line plus its module."""
from __future__ import annotations

import pytest

from flexgen_h2o.models import FAMILIES, PRESETS, Family, build_layers, family_of, from_hf_config, resolve_model
from flexgen_h2o.models import families
from flexgen_h2o.models.config import CheckpointConfigError
from flexgen_h2o.models.llama import build_llama_layers, llama_from_hf

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}


def test_presets_and_config_files_find_their_family():
    assert set(FAMILIES) == {"opt", "llama"}
    assert family_of(PRESETS["opt-125m"]).name == "opt" and family_of(resolve_model("smollm2-135m")).name == "llama"
    assert from_hf_config(dict(LLAMA, model_type="mistral")).family == "llama"
    assert from_hf_config(dict(LLAMA, model_type="qwen-ish", architectures=["LlamaForCausalLM"])).family == "llama"
    layers = build_layers(PRESETS["opt-125m"])
    assert [l.norm for l in layers[1:3]] == ["self_attn_layer_norm", "final_layer_norm"]
    assert build_layers(resolve_model("smollm2-135m"))[-1].norm == "norm"


def test_a_new_family_is_one_registry_line(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", {**FAMILIES, "tinyllama": Family(
        "tinyllama", "TinyLlama-like", build_llama_layers, llama_from_hf, ("tinyllama",))})
    cfg = from_hf_config(dict(LLAMA, model_type="tinyllama"))
    assert (cfg.family, cfg.n_kv_heads, cfg.head_dim) == ("llama", 2, 16)
    with pytest.raises(CheckpointConfigError, match='runs OPT, Llama-like and TinyLlama-like models'):
        from_hf_config(dict(LLAMA, model_type="gpt2"))
