"""Fixtures for the weight-store tests: tiny random HF OPT and Llama models and their configs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from flexgen_h2o.models import ModelConfig, all_specs, build_layers, from_hf_config


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def tiny_opt(proj: int = 64) -> OPTForCausalLM:
    torch.manual_seed(1)
    return OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=proj,
                                    do_layer_norm_before=proj == 64))


def cfg_of(model) -> ModelConfig:
    return from_hf_config(model.config.to_dict(), name="tiny-" + model.config.model_type)


def specs_of(cfg: ModelConfig) -> list:
    return all_specs(build_layers(cfg))


@pytest.fixture(scope="session")
def hf() -> SimpleNamespace:
    """The helpers above, as a fixture so test modules need not import this conftest."""
    return SimpleNamespace(tiny_llama=tiny_llama, tiny_opt=tiny_opt, cfg_of=cfg_of, specs_of=specs_of)


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory):
    """A saved tiny Llama (single model.safetensors) with its model and config, once per session (read only)."""
    model = tiny_llama()
    folder = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(folder)
    return folder, model, cfg_of(model)


@pytest.fixture(scope="session")
def llama_store(llama_folder, tmp_path_factory):
    from flexgen_h2o.weights import convert_checkpoint
    folder, model, cfg = llama_folder
    return convert_checkpoint(folder, cfg, tmp_path_factory.mktemp("stores") / "llama", progress=False), cfg
