"""Real weights: SmolLM2-135M-Instruct (Llama, GQA 9/3) from the bundled GGUF (tests/conftest.py's `smollm2`),
against transformers."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from flexgen_h2o.config import GenerationConfig
from flexgen_h2o.kv import EvictionConfig
from tests.helpers import assert_agree, loaded_engine
from tests.reference.compare import assert_same_as_reference, left_padded
from tests.reference.h2o_masked import reference_generate

pytestmark = pytest.mark.slow


def test_smollm2_logits_match_transformers(smollm2):
    loaded, model, prompts = smollm2
    n_new = 65
    engine = loaded_engine(loaded)
    out = engine.generate(prompts, GenerationConfig(max_new_tokens=n_new, stop_at_eos=False))
    ids, mask = left_padded(model, prompts)                 # pad id 2
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=2, eos_token_id=None)
    # the compiled kernels against transformers' GEMMs and sdpa: two fp32 orders, so tokens equal but at a near
    # tie, logits within tolerances.logit_bound up to there
    assert_agree(model, out.token_ids, engine.step_logits, ref.sequences[:, ids.shape[1]:].tolist(),
                 [[l[i] for l in ref.logits] for i in range(len(prompts))], False)
    assert "Paris" in loaded.tokenizer.decode(out.token_ids[0])


def test_smollm2_h2o_matches_masked_reference(smollm2):
    loaded, model, prompts = smollm2
    eviction = EvictionConfig(policy="h2o", hh_size=12, recent_size=8, sink_size=2)
    n_new = 24
    engine = loaded_engine(loaded, eviction)
    out = engine.generate(prompts, GenerationConfig(max_new_tokens=n_new, stop_at_eos=False))
    ids, mask = left_padded(model, prompts)                 # pad id 2
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
