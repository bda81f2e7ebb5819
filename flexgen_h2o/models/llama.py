"""Llama (and Llama-like, e.g. SmolLM2, Mistral-style configs): weight names and shapes in HF
`LlamaForCausalLM` layout, assembled into the shared layer kinds.

RoPE on q and k (inv_freq computed from theta, never loaded), RMSNorm, SwiGLU, no biases, GQA with K/V stored
at n_kv_heads (ANCHORS.md §2.7, §3.1).
"""
from __future__ import annotations

from flexgen_h2o.models.config import ModelConfig
from flexgen_h2o.models.layer import WeightSpec
from flexgen_h2o.models.transformer import AttentionLayer, EmbedLayer, HeadLayer, MLPLayer

HF_PREFIX = "model."


def _spec(key: str, name: str, shape: tuple[int, ...], init: str = "normal") -> WeightSpec:
    hf = "lm_head.weight" if name == "lm_head.weight" else HF_PREFIX + name
    return WeightSpec(key=key, name=name, shape=shape, hf_name=hf, init=init)


def build_llama_layers(cfg: ModelConfig) -> list:
    h, f = cfg.hidden_size, cfg.ffn_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    layers: list = [EmbedLayer("embed", cfg, [_spec("embed_tokens.weight", "embed_tokens.weight",
                                                    (cfg.vocab_size, h))])]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        attn = [_spec("self_attn.q_proj.weight", p + "self_attn.q_proj.weight", (q_dim, h)),
                _spec("self_attn.k_proj.weight", p + "self_attn.k_proj.weight", (kv_dim, h)),
                _spec("self_attn.v_proj.weight", p + "self_attn.v_proj.weight", (kv_dim, h)),
                _spec("self_attn.o_proj.weight", p + "self_attn.o_proj.weight", (h, q_dim)),
                _spec("input_layernorm.weight", p + "input_layernorm.weight", (h,), "ones")]
        if cfg.attn_bias:   # Qwen2-style configs carry q/k/v biases
            attn += [_spec(f"self_attn.{x}_proj.bias", p + f"self_attn.{x}_proj.bias", (d,), "zeros")
                     for x, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
        mlp = [_spec("mlp.gate_proj.weight", p + "mlp.gate_proj.weight", (f, h)),
               _spec("mlp.up_proj.weight", p + "mlp.up_proj.weight", (f, h)),
               _spec("mlp.down_proj.weight", p + "mlp.down_proj.weight", (h, f)),
               _spec("post_attention_layernorm.weight", p + "post_attention_layernorm.weight", (h,), "ones")]
        layers += [AttentionLayer(f"attn.{i}", cfg, attn, out_proj="o_proj"), MLPLayer(f"mlp.{i}", cfg, mlp)]
    lm_name = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    layers.append(HeadLayer("head", cfg, [_spec("norm.weight", "norm.weight", (h,), "ones"),
                                          _spec("lm_head.weight", lm_name, (cfg.vocab_size, h))]))
    return layers
