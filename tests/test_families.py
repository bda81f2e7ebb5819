"""The model families (models/families.py). Presets and config.json files find their family there; each Llama-like
family runs as transformers' own model does (random weights, fp32: a prompt pass and 64 decode steps, and H2O
against the masked reference); its presets are the hub checkpoints' shapes and tensor names; a sliding window is
honoured within it and refused past it.

A new Llama-like family: its line in models/families.py, its presets in models/config.py, and here its tiny
transformers model in MODELS (and its presets' hub classes in HUB)."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from flexgen_h2o.config import ConfigError
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import FAMILIES, PRESETS, Family, build_layers, family_of, from_hf_config, resolve_model
from flexgen_h2o.models import families
from flexgen_h2o.models.config import CheckpointConfigError
from flexgen_h2o.models.llama import build_llama_layers, llama_from_hf
from flexgen_h2o.models.transformer import all_specs
from tests.helpers import (VOCAB, assert_matches_transformers, engine_kept, greedy, make_engine, max_logit_diff,
                           random_prompts)
from tests.reference.h2o_masked import reference_generate
from tests.tolerances import eviction_tie_step, greedy_agreement, logit_bound, score_rel_bound

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 96                 # the windowed Mistral's: longer than every job below but the refused one
N_NEW = 65                  # the prefill step's logits + 64 decode steps
# kind -> (transformers class, its config): each family's own switches, one case each
MODELS = {
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**SHAPE, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e6})),
    "qwen2-tied": (Qwen2ForCausalLM, lambda: Qwen2Config(**dict(SHAPE, num_key_value_heads=1),
                                                         tie_word_embeddings=True)),
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**SHAPE, sliding_window=None)),
    "mistral-window": (MistralForCausalLM, lambda: MistralConfig(**SHAPE, sliding_window=WINDOW)),
    # queries 4 x 32 wide on a 64-wide model, as Mistral-Nemo's 32 x 128 on 5120
    "mistral-head-dim": (MistralForCausalLM, lambda: MistralConfig(**SHAPE, sliding_window=None, head_dim=32)),
    "llama-bias": (LlamaForCausalLM, lambda: LlamaConfig(**SHAPE, attention_bias=True)),     # q/k/v and o biases
}
HUB = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}
NEW_PRESETS = sorted(n for n, c in PRESETS.items() if c.family in HUB)


@functools.lru_cache(maxsize=None)
def tiny(kind: str):
    """A random fp32 model with fp16-exact weights (what a store keeps), scaled as tests.helpers.tiny_hf's; its
    biases random too, as transformers starts them at zero, where they would test nothing."""
    cls, make = MODELS[kind]
    torch.manual_seed(0)
    model = cls(make())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            p.copy_((p * (4.0 if p.dim() > 1 else 1.0)).half().float())
    return model.eval()


# --- the registry ---

def test_presets_and_config_files_find_their_family():
    assert set(FAMILIES) == {"opt", "llama", "qwen2", "mistral"}
    assert family_of(PRESETS["opt-125m"]).name == "opt" and family_of(resolve_model("smollm2-135m")).name == "llama"
    assert family_of(resolve_model("Qwen/Qwen2.5-7B-Instruct")).name == "qwen2"
    assert family_of(resolve_model("mistralai/Mistral-7B-Instruct-v0.3")).name == "mistral"
    assert from_hf_config(dict(LLAMA, model_type="mistral")).family == "mistral"
    assert from_hf_config(dict(LLAMA, model_type="qwen2")).family == "qwen2"
    assert from_hf_config(dict(LLAMA, model_type="qwen-ish", architectures=["Qwen2ForCausalLM"])).family == "qwen2"
    assert from_hf_config(dict(LLAMA, model_type="qwen-ish", architectures=["LlamaForCausalLM"])).family == "llama"
    layers = build_layers(PRESETS["opt-125m"])
    assert [l.norm for l in layers[1:3]] == ["self_attn_layer_norm", "final_layer_norm"]
    assert build_layers(resolve_model("smollm2-135m"))[-1].norm == "norm"


def test_a_new_family_is_one_registry_line(monkeypatch):
    monkeypatch.setattr(families, "FAMILIES", {**FAMILIES, "tinyllama": families.llama_like(
        "tinyllama", "TinyLlama-like", ("tinyllama",), qkv_bias=True)})
    cfg = from_hf_config(dict(LLAMA, model_type="tinyllama"))
    assert (cfg.family, cfg.n_kv_heads, cfg.head_dim, cfg.attn_bias, cfg.out_bias) == ("tinyllama", 2, 16, True, False)
    assert [s.name for s in build_layers(cfg)[1].weight_specs()][-3:] == [
        "layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias", "layers.0.self_attn.v_proj.bias"]
    with pytest.raises(CheckpointConfigError, match='runs OPT, Llama-like, Qwen2, Mistral and TinyLlama-like models'):
        from_hf_config(dict(LLAMA, model_type="gpt2"))
    # a family of its own module: any build function and reader
    monkeypatch.setattr(families, "FAMILIES", {"other": Family("other", "Other", build_llama_layers, llama_from_hf,
                                                               ("other",))})
    assert from_hf_config(dict(LLAMA, model_type="other")).family == "llama"


def test_config_json_switches():
    qwen = dict(LLAMA, model_type="qwen2", max_position_embeddings=4096, sliding_window=64, max_window_layers=2)
    # a window only where use_sliding_window is on and some layer slides (layer_types, else max_window_layers)
    assert from_hf_config(dict(qwen, use_sliding_window=False)).max_seq_len == 4096
    assert from_hf_config(dict(qwen, use_sliding_window=True)).max_seq_len == 4096        # layers 2.. slide: none
    assert from_hf_config(dict(qwen, use_sliding_window=True, max_window_layers=1)).max_seq_len == 64
    assert from_hf_config(dict(qwen, use_sliding_window=True, layer_types=["full_attention"] * 2)).max_seq_len == 4096
    mistral = dict(LLAMA, model_type="mistral", max_position_embeddings=4096)
    assert from_hf_config(dict(mistral, sliding_window=64)).max_seq_len == 64
    assert from_hf_config(dict(mistral, sliding_window=None)).max_seq_len == 4096
    assert from_hf_config(dict(mistral, sliding_window=64, model_type="llama")).max_seq_len == 4096   # Llama has none
    llama = from_hf_config(dict(LLAMA, attention_bias=True))
    assert (llama.attn_bias, llama.out_bias) == (True, True)
    with pytest.raises(CheckpointConfigError, match='"mlp_bias": true is not supported'):
        from_hf_config(dict(LLAMA, mlp_bias=True))


# --- against transformers ---

@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_and_tokens_match_transformers(kind):
    engine = assert_matches_transformers(tiny(kind), n_new=N_NEW)
    assert engine.model.family == kind.split("-")[0]


@pytest.mark.parametrize("kind", ["qwen2", "mistral-window"])
def test_h2o_matches_the_masked_reference(kind):
    """H2O (heavy 4, recent 3) on prompts longer than the budget, against transformers' model with eviction
    simulated by masks, as tests/test_h2o_engine.py checks OPT and Llama: tokens and logits up to a near tie,
    and the kept positions of every sequence no near tie split."""
    model, prompts, n_new = tiny(kind), random_prompts([20, 13, 24]), 16
    ev = EvictionConfig(policy="h2o", hh_size=4, recent_size=3)
    engine = make_engine(model, eviction=ev)
    try:
        out = engine.generate(prompts, greedy(n_new))
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
        trace: list = []
        evd: dict = {}
        tokens, logits = reference_generate(model, ids, mask, [ev.resolve(len(p), n_new) for p in prompts],
                                            rule="exact", max_new_tokens=n_new, trace=trace, eviction=evd)
        cfg = model.config
        keys = evd["width"] + n_new
        rel = score_rel_bound(model, evd["attn_mag"], keys, keys * cfg.num_attention_heads // cfg.num_key_value_heads)
        ties = eviction_tie_step(evd["gaps"], rel, n_new, "reference")
        whole = []
        for i in range(len(prompts)):
            want = [l[i] for l in logits]
            bound = logit_bound(model, torch.stack(want))
            n = greedy_agreement(out.token_ids[i][:ties[i]], tokens[i, :ties[i]].tolist(), want, bound, f"seq {i}")
            assert max_logit_diff(engine.step_logits[i][:n], want[:n]) <= bound, f"sequence {i}"
            whole += [i] if n == n_new else []
        assert whole, "every sequence met a near tie: the case checks no kept positions"
        kept = engine_kept(engine)
        assert [[x[i] for i in whole] for x in kept] == [[x[i] for i in whole] for x in trace[-1]]
        assert all(len(col) == 4 + 3 for layer in kept for seq in layer for col in seq)
    finally:
        engine.close()


# --- the sliding window ---

def test_a_job_longer_than_the_sliding_window_is_refused():
    engine = make_engine(tiny("mistral-window"), record=False)
    assert engine.model.max_seq_len == WINDOW
    with pytest.raises(ConfigError, match=rf"\(90 tokens\) \+ max_new_tokens \(8\) exceed the context window "
                                          rf"\({WINDOW}\)"):
        engine.generate(random_prompts([90]), greedy(8))


def test_the_cli_refuses_it_in_one_line(tmp_path, monkeypatch, capsys):
    from flexgen_h2o import run
    tiny("mistral-window").save_pretrained(tmp_path / "ckpt")
    monkeypatch.setenv("FLEXGEN_H2O_HOME", str(tmp_path / "home"))
    capsys.readouterr()                                    # transformers' progress bar while saving
    rc = run.main(["--model", str(tmp_path / "ckpt"), "--prompt-len", "90", "--gen-len", "8", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: ") and f"exceed the context window ({WINDOW})" in err[0]


# --- presets ---

# the config.json of three hub checkpoints, as published (the fields the engine reads)
HUB_CONFIGS = {
    "mistral-7b-v0.1": dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=4096,
                            intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096,
                            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, vocab_size=32000,
                            bos_token_id=1, eos_token_id=2),
    "qwen2.5-0.5b-instruct": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896,
                                  intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                  num_key_value_heads=2, max_position_embeddings=32768, max_window_layers=21,
                                  sliding_window=32768, use_sliding_window=False, rms_norm_eps=1e-6,
                                  rope_theta=1000000.0, tie_word_embeddings=True, vocab_size=151936,
                                  bos_token_id=151643, eos_token_id=151645),
    "qwen2.5-14b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=5120,
                        intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                        max_position_embeddings=131072, max_window_layers=48, sliding_window=131072,
                        use_sliding_window=False, rms_norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=False,
                        vocab_size=152064, bos_token_id=151643, eos_token_id=151643),
}


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_presets_are_their_checkpoints_config(name):
    preset = PRESETS[name]
    assert from_hf_config(HUB_CONFIGS[name], name=name).replace(hf_id=preset.hf_id) == preset


def test_preset_sizes_are_the_checkpoints():
    # the parameter counts of the hub's safetensors
    assert PRESETS["qwen2.5-0.5b"].n_params() == 494_032_768
    assert PRESETS["qwen2.5-7b"].n_params() == 7_615_616_512
    assert PRESETS["qwen2.5-72b"].n_params() == 72_706_203_648
    assert PRESETS["mistral-7b-v0.1"].n_params() == 7_241_732_096
    assert PRESETS["mistral-nemo-12b"].n_params() == 12_247_782_400


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_presets_map_the_hub_tensors(name):
    """Every tensor the preset needs is the hub model's, by name and shape (transformers builds it on the meta
    device from the preset's config.json fields, with two of its layers: the others repeat them), and nothing the
    model has is left out but a tied lm_head."""
    assert resolve_model(PRESETS[name].hf_id) is PRESETS[name]
    cfg = PRESETS[name].replace(n_layers=2)
    hf_config, hf_model = HUB[cfg.family]
    fields = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_size,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                  tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    if cfg.family == "mistral":
        fields.update(head_dim=cfg.head_dim, sliding_window=None)
    with torch.device("meta"):
        model = hf_model(hf_config(**fields))
    assert from_hf_config(model.config.to_dict(), name=name).replace(hf_id=cfg.hf_id) == cfg
    have = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        have.pop("lm_head.weight")
    assert {s.hf_name: s.shape for s in all_specs(build_layers(cfg))} == have


def test_a_checkpoint_converts_with_its_biases(tmp_path):
    """The hub path's converter (weights/convert.py) on a saved Qwen2 checkpoint: q/k/v biases found by name, the
    tied lm_head not needed, every tensor the checkpoint's (fp16)."""
    from flexgen_h2o.weights import convert_checkpoint, open_store
    model = tiny("qwen2-tied")
    model.save_pretrained(tmp_path / "ckpt")
    cfg = from_hf_config(model.config.to_dict(), name="qwen2-tiny")
    specs = all_specs(build_layers(cfg))
    store = open_store(convert_checkpoint(tmp_path / "ckpt", cfg, tmp_path / "store", progress=False), specs)
    state = model.state_dict()
    assert sum(s.name.endswith("_proj.bias") for s in specs) == 3 * cfg.n_layers
    for s in specs:
        assert torch.equal(torch.from_numpy(store.read(s.name).copy()), state[s.hf_name].half()), s.name


def test_a_small_preset_runs_on_dummy_weights(tmp_path, monkeypatch, capsys):
    from flexgen_h2o import run
    monkeypatch.setenv("FLEXGEN_H2O_HOME", str(tmp_path))
    rc = run.main(["--model", "qwen2.5-0.5b", "--dummy-weights", "--prompt-len", "4", "--gen-len", "2",
                   "--gpu-batch-size", "1", "--no-warmup", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "model: qwen2.5-0.5b (qwen2, 24 layers, width 896)" in out
