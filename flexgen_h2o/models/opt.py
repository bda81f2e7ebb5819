"""OPT: weight names and shapes (HF `OPTForCausalLM` layout), assembled into the shared layer kinds.

Learned positions with offset 2, LayerNorm, ReLU, biases everywhere; opt-350m is post-LN with project_in/out
and no final LayerNorm.
"""
from __future__ import annotations

from typing import Any

from flexgen_h2o.models.config import HFFields, ModelConfig
from flexgen_h2o.models.layer import WeightSpec
from flexgen_h2o.models.transformer import AttentionLayer, EmbedLayer, HeadLayer, MLPLayer

HF_PREFIX = "model.decoder."


def _spec(key: str, name: str, shape: tuple[int, ...], init: str = "normal") -> WeightSpec:
    hf = "lm_head.weight" if name == "lm_head.weight" else HF_PREFIX + name
    return WeightSpec(key=key, name=name, shape=shape, hf_name=hf, init=init)


def _ln(key: str, name: str, h: int) -> list[WeightSpec]:
    return [_spec(key + ".weight", name + ".weight", (h,), "ones"), _spec(key + ".bias", name + ".bias", (h,), "zeros")]


def _linear(key: str, name: str, out_dim: int, in_dim: int, bias: bool) -> list[WeightSpec]:
    specs = [_spec(key + ".weight", name + ".weight", (out_dim, in_dim))]
    if bias:
        specs.append(_spec(key + ".bias", name + ".bias", (out_dim,), "zeros"))
    return specs


def build_opt_layers(cfg: ModelConfig) -> list:
    h, e, f = cfg.hidden_size, cfg.embed_dim, cfg.ffn_size
    embed = [_spec("embed_tokens.weight", "embed_tokens.weight", (cfg.vocab_size, e)),
             _spec("embed_positions.weight", "embed_positions.weight", (cfg.max_seq_len + 2, h))]
    if e != h:
        embed += _linear("project_in", "project_in", h, e, bias=False)
    layers: list = [EmbedLayer("embed", cfg, embed)]
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        attn = []
        for proj in ("q_proj", "k_proj", "v_proj"):
            attn += _linear(f"self_attn.{proj}", p + f"self_attn.{proj}", h, h, cfg.attn_bias)
        attn += _linear("self_attn.out_proj", p + "self_attn.out_proj", h, h, cfg.out_bias)
        attn += _ln("self_attn_layer_norm", p + "self_attn_layer_norm", h)
        mlp = (_linear("fc1", p + "fc1", f, h, cfg.mlp_bias) + _linear("fc2", p + "fc2", h, f, cfg.mlp_bias)
               + _ln("final_layer_norm", p + "final_layer_norm", h))
        layers += [AttentionLayer(f"attn.{i}", cfg, attn, out_proj="out_proj", norm="self_attn_layer_norm"),
                   MLPLayer(f"mlp.{i}", cfg, mlp, norm="final_layer_norm")]
    head = _ln("final_layer_norm", "final_layer_norm", h) if cfg.final_norm else []
    if e != h:
        head += _linear("project_out", "project_out", e, h, bias=False)
    lm_name = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head.append(_spec("lm_head.weight", lm_name, (cfg.vocab_size, e)))
    layers.append(HeadLayer("head", cfg, head, norm="final_layer_norm"))
    return layers


def opt_from_hf(f: HFFields, common: dict[str, Any]) -> ModelConfig:
    """An OPT config.json's own fields (`common`: the shapes every family reads)."""
    hidden, heads = common["hidden_size"], common["n_heads"]
    proj = f.int("word_embed_proj_dim", hidden)
    pre = f.flag("do_layer_norm_before", True)
    bias = f.flag("enable_bias", True)
    act = f.get("activation_function", "relu", "\"relu\" (every OPT model uses it)", lambda v: v == "relu")
    return ModelConfig(
        family="opt", n_kv_heads=heads, ffn_size=f.int("ffn_dim"), activation=act, pre_norm=pre,
        word_embed_dim=proj if proj != hidden else None, attn_bias=bias, out_bias=bias, mlp_bias=bias,
        final_norm=pre and not f.flag("_remove_final_layer_norm", False),
        tie_word_embeddings=f.flag("tie_word_embeddings", True), bos_id=f.token("bos_token_id", 2),
        eos_id=f.token("eos_token_id", 2), pad_id=f.token("pad_token_id", 1), **common)
