"""Fixtures of the accuracy harness's tests, made once per session."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flexgen_h2o.loader import fallback_tokenizer


@pytest.fixture(scope="session")
def tok():
    """SmolLM2's converted tokenizer (the harness's items are its tokens)."""
    t = fallback_tokenizer()
    if t is None:
        pytest.skip("SmolLM2's tokenizer is not converted yet (make run)")
    return t


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, tok):
    """A random 2-layer Llama with SmolLM2's vocabulary (so the real tokenizer drives it) and a 512 window."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder
