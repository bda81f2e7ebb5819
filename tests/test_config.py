"""ModelConfig presets, HF id mapping, local config.json folders, and the clear error for unknown names."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig, OPTConfig

from flexgen_h2o.config import split_by_fraction
from flexgen_h2o.models import PRESETS, ModelNameError, resolve_model


def test_preset_sizes_match_the_published_models():
    assert PRESETS["smollm2-135m"].n_params() == 134_515_008          # exact count of the real checkpoint
    assert PRESETS["smollm2-135m"].n_kv_heads == 3 and PRESETS["smollm2-135m"].n_heads == 9
    assert abs(PRESETS["opt-30b"].n_params() * 2 / 2**30 - 55.80) < 0.1  # FlexGen's model_bytes, GiB
    assert abs(PRESETS["llama-2-70b"].n_params() / 1e9 - 68.98) < 0.1
    assert PRESETS["opt-350m"].pre_norm is False and PRESETS["opt-350m"].word_embed_dim == 512
    assert PRESETS["llama-3.1-8b"].rope_scaling_dict["rope_type"] == "llama3"
    assert PRESETS["opt-30b"].kv_bytes_per_token() == 1344 * 1024


def test_hf_ids_map_to_presets():
    assert resolve_model("facebook/opt-30b") is PRESETS["opt-30b"]
    assert resolve_model("meta-llama/Llama-2-7b-hf") is PRESETS["llama-2-7b"]
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") is PRESETS["smollm2-135m"]


@pytest.mark.parametrize("hf_cfg, family, kv_heads", [
    (OPTConfig(hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4), "opt", 4),
    (LlamaConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2), "llama", 2),
    (MistralConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=1, sliding_window=None), "mistral", 1),
])
def test_local_checkpoint_folder_is_read_from_config_json(tmp_path, hf_cfg, family, kv_heads):
    hf_cfg.save_pretrained(tmp_path)
    cfg = resolve_model(str(tmp_path))
    assert (cfg.family, cfg.n_layers, cfg.hidden_size, cfg.n_kv_heads) == (family, 2, 64, kv_heads)


def test_unknown_model_names_say_what_is_accepted():
    with pytest.raises(ModelNameError, match="unknown model 'opt-31b'.*preset"):
        resolve_model("opt-31b")


@pytest.mark.parametrize("n, fractions, want", [
    (1, (0.5, 0.5, 0.0), [(0, 1, "compute")]),               # a half rounds up; no disk share, never disk
    (3, (0.5, 0.5, 0.0), [(0, 2, "compute"), (2, 3, "host")]),
    (3, (0.0, 0.5, 0.5), [(0, 2, "host"), (2, 3, "disk")]),
    (4, (0.34, 0.33, 0.33), [(0, 1, "compute"), (1, 2, "host"), (2, 4, "disk")]),
    (5, (0.0, 0.0, 1.0), [(0, 5, "disk")]),
    (2, (1.0, 0.0, 0.0), [(0, 2, "compute")]),
])
def test_split_by_fraction(n, fractions, want):
    assert split_by_fraction(n, fractions) == want
