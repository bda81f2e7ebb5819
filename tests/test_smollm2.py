"""Real weights: SmolLM2-135M-Instruct (Llama, GQA 9/3) from the bundled GGUF, against transformers."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flexgen_h2o.config import GenerationConfig, OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.loader import load_model
from tests.reference.h2o_masked import reference_generate
from tests.helpers import assert_agree
from tests.test_h2o_engine import assert_same_as_reference

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow and explain where rainbows come from."]


@pytest.fixture(scope="module")
def smol():
    loaded = load_model("smollm2-135m", progress=False)
    cfg = loaded.config
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers,
                         intermediate_size=cfg.ffn_size, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
                         rms_norm_eps=cfg.norm_eps, rope_parameters={"rope_type": "default",
                                                                     "rope_theta": cfg.rope_theta},
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(hf_cfg)
    state = {}
    for name, param in model.state_dict().items():
        ours = name.removeprefix("model.") if name != "lm_head.weight" else "embed_tokens.weight"
        state[name] = torch.from_numpy(loaded.read(ours).copy()).float()
    model.load_state_dict(state)
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in QUESTIONS]
    return loaded, model.eval(), prompts


def _padded(prompts, pad_id):
    n = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _engine(loaded, eviction=None):
    engine = Engine(loaded.config, loaded.read, offload=OffloadPolicy(kv_dtype="float32", gpu_batch_size=4),
                    eviction=eviction)
    engine.step_logits = {}
    engine.on_step_logits = lambda t, seqs, logits: [engine.step_logits.setdefault(s, []).append(logits[r].clone())
                                                     for r, s in enumerate(seqs)]
    return engine


def test_smollm2_logits_match_transformers(smol):
    loaded, model, prompts = smol
    n_new = 65
    engine = _engine(loaded)
    out = engine.generate(prompts, GenerationConfig(max_new_tokens=n_new, stop_at_eos=False))
    ids, mask = _padded(prompts, 2)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=2, eos_token_id=None)
    # the compiled kernels against transformers' GEMMs and sdpa: two fp32 orders, so tokens equal but at a near
    # tie, logits within tolerances.logit_bound up to there
    assert_agree(model, out.token_ids, engine.step_logits, ref.sequences[:, ids.shape[1]:].tolist(),
                 [[l[i] for l in ref.logits] for i in range(len(prompts))], False)
    assert "Paris" in loaded.tokenizer.decode(out.token_ids[0])


def test_smollm2_h2o_matches_masked_reference(smol):
    loaded, model, prompts = smol
    eviction = EvictionConfig(policy="h2o", hh_size=12, recent_size=8, sink_size=2)
    n_new = 24
    engine = _engine(loaded, eviction)
    out = engine.generate(prompts, GenerationConfig(max_new_tokens=n_new, stop_at_eos=False))
    ids, mask = _padded(prompts, 2)
    evd: dict = {}
    ref_tokens, ref_logits = reference_generate(model, ids, mask, budget=(2, 12, 8), rule="exact",
                                                max_new_tokens=n_new, eviction=evd)
    # two fp32 orders of one eviction rule: tokens and logits as test_h2o_engine holds them, up to the
    # reference's first eviction at a near tie
    assert_same_as_reference(model, engine, out, ref_tokens, ref_logits, evd)


def test_run_entry_point_generates_text(tmp_path):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.run([sys.executable, "-m", "flexgen_h2o.run", "--model", "smollm2-135m", "--gen-len", "12",
                           "--prompt", "What is the capital of France?", "--metrics-json", str(tmp_path / "m.json")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert "decode throughput" in proc.stdout and "total throughput" in proc.stdout
