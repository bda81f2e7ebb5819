"""ModelConfig: one frozen description of an OPT or Llama-family decoder, plus named presets.

Owns shapes and hyper-parameters only; imports nothing from the package. Sources for the preset numbers:
the HF config.json of each checkpoint (ANCHORS.md §3.4, §3.5).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any


class ModelNameError(ValueError):
    """An unknown model name, HF id or folder; the message says what is accepted."""


@dataclass(frozen=True)
class ModelConfig:
    name: str                          # preset name or folder path, for logs
    family: str                        # "opt" or "llama"
    n_layers: int
    hidden_size: int                   # model width m
    n_heads: int                       # query heads h
    n_kv_heads: int                    # KV heads g (== n_heads for MHA)
    head_dim: int                      # d
    ffn_size: int
    vocab_size: int
    max_seq_len: int                   # context window the positions were trained for
    activation: str = "relu"           # "relu" (OPT) or "silu" (Llama SwiGLU)
    norm: str = "layernorm"            # "layernorm" or "rmsnorm"
    norm_eps: float = 1e-5
    pre_norm: bool = True              # False only for opt-350m (post-LN)
    positions: str = "learned"         # "learned" (OPT, offset 2) or "rope"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None   # e.g. llama3 scaling, as sorted items (hashable)
    tie_word_embeddings: bool = True
    word_embed_dim: int | None = None  # OPT project_in/out width when it differs from hidden_size
    attn_bias: bool = True             # OPT has q/k/v/out biases, Llama none
    mlp_bias: bool = True
    final_norm: bool = True            # opt-350m has no final LayerNorm
    bos_id: int | None = 2
    eos_id: int | None = 2
    pad_id: int | None = 1
    hf_id: str | None = None           # where the hub download path would fetch it

    @property
    def embed_dim(self) -> int:
        return self.word_embed_dim or self.hidden_size

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V bytes one token costs across all layers (ANCHORS.md §5.5)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def workspace_bytes(self, batch: int, tokens: int, itemsize: int = 4, score_block_bytes: int = 0) -> int:
        """Estimated transient bytes of the largest single layer forward for `batch` sequences of `tokens` new
        tokens (a prefill chunk is the peak): the layer's output next to its input, plus the attention block
        (q/k/v and output, and when scores are wanted (score_block_bytes > 0: the largest fp32 logits block,
        `ops.score_block_bytes`) that block's logits and probabilities; measured ~120 MiB for one SmolLM2
        sequence of 2048 in 256-query blocks, allocator slack included, hence 4 copies) or the MLP's ffn-wide
        intermediates, or the head's last-token logits. Without scores the fused SDPA kernel keeps O(tokens)
        state (measured on CPU: 43 MiB for 2 x 2048 SmolLM2 tokens, not the 600 MiB of a materialised score
        matrix)."""
        h, f, d = self.hidden_size, self.ffn_size, self.head_dim
        bt = batch * tokens
        hidden = 2 * bt * h * itemsize
        qkv = bt * (2 * self.n_heads + 2 * self.n_kv_heads) * d * itemsize
        if score_block_bytes:
            probs = 4 * score_block_bytes + batch * self.n_kv_heads * tokens * 4
        else:
            probs = bt * self.n_heads * d * itemsize
        mlp = bt * f * itemsize * (3 if self.activation == "silu" else 2)
        head = 2 * batch * self.vocab_size * 4
        return hidden + max(qkv + probs, mlp, head)

    def n_params(self) -> int:
        h, e, f, v = self.hidden_size, self.embed_dim, self.ffn_size, self.vocab_size
        kv = self.n_kv_heads * self.head_dim
        attn = h * (h + 2 * kv) + h * h + ((h + 2 * kv + h) if self.attn_bias else 0)
        n_mats = 2 if self.activation == "relu" else 3
        mlp = n_mats * h * f + ((f + h) if self.mlp_bias else 0)
        norm_params = 2 * h if self.norm == "layernorm" else h
        total = self.n_layers * (attn + mlp + 2 * norm_params) + v * e
        total += norm_params if self.final_norm else 0
        total += 0 if self.tie_word_embeddings else v * e
        if self.positions == "learned":
            total += (self.max_seq_len + 2) * h
        if self.word_embed_dim and self.word_embed_dim != h:
            total += 2 * h * e
        return total

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# --- presets ---

def _opt(name: str, layers: int, hidden: int, heads: int, **kw: Any) -> ModelConfig:
    return ModelConfig(name=name, family="opt", n_layers=layers, hidden_size=hidden, n_heads=heads,
                       n_kv_heads=heads, head_dim=hidden // heads, ffn_size=4 * hidden, vocab_size=50272,
                       max_seq_len=2048, hf_id=f"facebook/{name}", **kw)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, ctx: int,
           theta: float, eps: float, hf_id: str, **kw: Any) -> ModelConfig:
    fields = dict(bos_id=1, eos_id=2, pad_id=None, tie_word_embeddings=False)
    fields.update(kw)
    return ModelConfig(name=name, family="llama", n_layers=layers, hidden_size=hidden, n_heads=heads,
                       n_kv_heads=kv_heads, head_dim=hidden // heads, ffn_size=ffn, vocab_size=vocab,
                       max_seq_len=ctx, activation="silu", norm="rmsnorm", norm_eps=eps, positions="rope",
                       rope_theta=theta, attn_bias=False, mlp_bias=False, hf_id=hf_id, **fields)


_LLAMA3_SCALING = tuple(sorted({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}.items()))
_L3 = dict(bos_id=128000, eos_id=128001, pad_id=None)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _opt("opt-125m", 12, 768, 12),
    _opt("opt-350m", 24, 1024, 16, pre_norm=False, word_embed_dim=512, final_norm=False),
    _opt("opt-1.3b", 24, 2048, 32),
    _opt("opt-2.7b", 32, 2560, 32),
    _opt("opt-6.7b", 32, 4096, 32),
    _opt("opt-13b", 40, 5120, 40),
    _opt("opt-30b", 48, 7168, 56),
    _opt("opt-66b", 64, 9216, 72),
    _opt("opt-175b", 96, 12288, 96),
    _llama("llama-7b", 32, 4096, 32, 32, 11008, 32000, 2048, 1e4, 1e-6, "huggyllama/llama-7b"),
    _llama("llama-13b", 40, 5120, 40, 40, 13824, 32000, 2048, 1e4, 1e-6, "huggyllama/llama-13b"),
    _llama("llama-30b", 60, 6656, 52, 52, 17920, 32000, 2048, 1e4, 1e-6, "huggyllama/llama-30b"),
    _llama("llama-65b", 80, 8192, 64, 64, 22016, 32000, 2048, 1e4, 1e-5, "huggyllama/llama-65b"),
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, 1e4, 1e-5, "meta-llama/Llama-2-7b-hf"),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, 1e4, 1e-5, "meta-llama/Llama-2-13b-hf"),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, 1e4, 1e-5, "meta-llama/Llama-2-70b-hf"),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, 5e5, 1e-5, "meta-llama/Meta-Llama-3-8B", **_L3),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, 5e5, 1e-5, "meta-llama/Meta-Llama-3-70B", **_L3),
    _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, 131072, 5e5, 1e-5, "meta-llama/Llama-3.1-8B",
           rope_scaling=_LLAMA3_SCALING, **_L3),
    _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, 131072, 5e5, 1e-5, "meta-llama/Llama-3.1-70B",
           rope_scaling=_LLAMA3_SCALING, **_L3),
    _llama("smollm2-135m", 30, 576, 9, 3, 1536, 49152, 8192, 1e5, 1e-5, "HuggingFaceTB/SmolLM2-135M-Instruct",
           tie_word_embeddings=True, bos_id=1, eos_id=2, pad_id=2),
]}

HF_ID_TO_PRESET: dict[str, str] = {c.hf_id.lower(): n for n, c in PRESETS.items() if c.hf_id}
HF_ID_TO_PRESET.update({"huggingfacetb/smollm2-135m": "smollm2-135m", "meta-llama/llama-2-7b-chat-hf": "llama-2-7b",
                        "meta-llama/llama-2-13b-chat-hf": "llama-2-13b", "meta-llama/llama-2-70b-chat-hf":
                        "llama-2-70b", "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
                        "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b"})


# --- reading HF config.json ---

def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def from_hf_config(hf: dict[str, Any], name: str = "custom") -> ModelConfig:
    """Map an HF config dict (OPT, or Llama-like: llama/mistral/qwen2-style without biases) to a ModelConfig."""
    model_type = hf.get("model_type", "")
    if model_type == "opt":
        hidden = hf["hidden_size"]
        proj = hf.get("word_embed_proj_dim", hidden)
        pre = hf.get("do_layer_norm_before", True)
        heads = hf["num_attention_heads"]
        bias = hf.get("enable_bias", True)
        return ModelConfig(
            name=name, family="opt", n_layers=hf["num_hidden_layers"], hidden_size=hidden, n_heads=heads,
            n_kv_heads=heads, head_dim=hidden // heads, ffn_size=hf["ffn_dim"], vocab_size=hf["vocab_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048), activation=hf.get("activation_function", "relu"),
            pre_norm=pre, word_embed_dim=proj if proj != hidden else None, attn_bias=bias, mlp_bias=bias,
            final_norm=pre and not hf.get("_remove_final_layer_norm", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            bos_id=hf.get("bos_token_id", 2), eos_id=hf.get("eos_token_id", 2), pad_id=hf.get("pad_token_id", 1))
    if model_type in ("llama", "mistral") or "LlamaForCausalLM" in hf.get("architectures", []):
        hidden = hf["hidden_size"]
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})
        theta = _first(rope, "rope_theta", default=None) or hf.get("rope_theta", 10000.0)
        scaling = dict(hf.get("rope_scaling") or {}) or {k: v for k, v in rope.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ModelNameError(f"{name}: rope type {rope_type!r} is not supported (only default and llama3)")
        if hf.get("sliding_window") and hf.get("use_sliding_window", True) and model_type == "mistral":
            raise ModelNameError(f"{name}: sliding-window attention is not supported")
        eos = hf.get("eos_token_id")
        return ModelConfig(
            name=name, family="llama", n_layers=hf["num_hidden_layers"], hidden_size=hidden, n_heads=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or hidden // heads,
            ffn_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048), activation="silu", norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6), positions="rope", rope_theta=float(theta),
            rope_scaling=tuple(sorted(scaling.items())) if rope_type == "llama3" else None,
            tie_word_embeddings=hf.get("tie_word_embeddings", False), attn_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False), bos_id=hf.get("bos_token_id"),
            eos_id=eos[0] if isinstance(eos, list) else eos, pad_id=hf.get("pad_token_id"))
    raise ModelNameError(f"{name}: model_type {model_type!r} is not supported; flexgen_h2o runs OPT and Llama-like "
                         "models")


def resolve_model(spec: str) -> ModelConfig:
    """A preset name (`opt-30b`), an HF id (`facebook/opt-30b`) or a local folder with config.json."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.lower() in HF_ID_TO_PRESET:
        return PRESETS[HF_ID_TO_PRESET[spec.lower()]]
    cfg_path = os.path.join(os.path.expanduser(spec), "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            return from_hf_config(json.load(f), name=spec)
    raise ModelNameError(f"unknown model {spec!r}: use a preset ({', '.join(sorted(PRESETS))}), one of their HF ids, "
                         "or a local checkpoint folder with a config.json")
