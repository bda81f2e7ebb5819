"""Llama (and Llama-like, e.g. SmolLM2, Mistral-style configs): weight names and shapes in HF
`LlamaForCausalLM` layout, assembled into the shared layer kinds.

RoPE on q and k (inv_freq computed from theta, never loaded), RMSNorm, SwiGLU, no biases, GQA with K/V stored
at n_kv_heads.
"""
from __future__ import annotations

from typing import Any

from flexgen_h2o.models.config import CheckpointConfigError, HFFields, ModelConfig, ModelNameError, first_set
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
        if cfg.attn_bias:
            attn += [_spec(f"self_attn.{x}_proj.bias", p + f"self_attn.{x}_proj.bias", (d,), "zeros")
                     for x, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
        if cfg.out_bias:
            attn.append(_spec("self_attn.o_proj.bias", p + "self_attn.o_proj.bias", (h,), "zeros"))
        mlp = [_spec("mlp.gate_proj.weight", p + "mlp.gate_proj.weight", (f, h)),
               _spec("mlp.up_proj.weight", p + "mlp.up_proj.weight", (f, h)),
               _spec("mlp.down_proj.weight", p + "mlp.down_proj.weight", (h, f)),
               _spec("post_attention_layernorm.weight", p + "post_attention_layernorm.weight", (h,), "ones")]
        layers += [AttentionLayer(f"attn.{i}", cfg, attn, out_proj="o_proj", norm="input_layernorm"),
                   MLPLayer(f"mlp.{i}", cfg, mlp, norm="post_attention_layernorm")]
    lm_name = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    layers.append(HeadLayer("head", cfg, [_spec("norm.weight", "norm.weight", (h,), "ones"),
                                          _spec("lm_head.weight", lm_name, (cfg.vocab_size, h))], norm="norm"))
    return layers


def sliding_window(f: HFFields, n_layers: int) -> int | None:
    """The window of a config.json whose layers (any of them) attend to their last `sliding_window` tokens only:
    all layers (Mistral), those `layer_types` names "sliding_attention" (transformers 5), or, where only
    `max_window_layers` says, the layers from that index on (Qwen2); `use_sliding_window: false` turns it off."""
    window = f.int("sliding_window", None)
    if window is None or not f.flag("use_sliding_window", True):
        return None
    types = f.hf.get("layer_types")
    if isinstance(types, list):
        return window if "sliding_attention" in types else None
    first = f.hf.get("max_window_layers")
    return None if isinstance(first, int) and first >= n_layers else window


def llama_from_hf(f: HFFields, common: dict[str, Any], family: str = "llama", qkv_bias: bool | None = None,
                  windowed: bool = False) -> ModelConfig:
    """A Llama-like config.json's own fields (`common`: the shapes every family reads). family: the registry
    name the config gets; qkv_bias: the family always has q/k/v biases and no o_proj bias (Qwen2), else
    `attention_bias` sets all four; windowed: the family reads a sliding window (`sliding_window`), which caps the
    context: the engine's attention sees every kept key, so a job within the window is exactly the model's and
    a longer one is refused by the context-window check (ModelConfig.max_seq_len), as a job past a model's
    positions is; position rolling, which may run past either, keeps the rolled distances below the KV budget."""
    heads = common["n_heads"]
    kv_heads = f.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise CheckpointConfigError(f"{f.where}: \"num_attention_heads\" ({heads}) is not a multiple of "
                                    f"\"num_key_value_heads\" ({kv_heads}); fix one of them")
    rope = f.obj("rope_parameters")
    theta = first_set(rope, "rope_theta", default=None) or f.num("rope_theta", 10000.0)
    scaling = f.obj("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelNameError(f"{f.where}: rope type {rope_type!r} is not supported (only default and llama3)")
    if f.flag("mlp_bias", False):     # the SwiGLU kernels take no biases: refused, never dropped
        raise CheckpointConfigError(f"{f.where}: \"mlp_bias\": true is not supported (MLP biases)")
    window = sliding_window(f, common["n_layers"]) if windowed else None
    if window is not None:
        common = dict(common, max_seq_len=min(common["max_seq_len"], window))
    bias = f.flag("attention_bias", False)
    return ModelConfig(
        family=family, n_kv_heads=kv_heads, ffn_size=f.int("intermediate_size"), activation="silu",
        norm="rmsnorm", norm_eps=f.num("rms_norm_eps", 1e-6), positions="rope", rope_theta=float(theta),
        rope_scaling=tuple(sorted(scaling.items())) if rope_type == "llama3" else None,
        tie_word_embeddings=f.flag("tie_word_embeddings", False), attn_bias=bias if qkv_bias is None else qkv_bias,
        out_bias=bias if qkv_bias is None else False, mlp_bias=False,
        bos_id=f.token("bos_token_id"), eos_id=f.token("eos_token_id"), pad_id=f.token("pad_token_id"), **common)
