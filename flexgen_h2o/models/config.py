"""ModelConfig: one frozen description of an OPT or Llama-like decoder, plus named presets.

Owns shapes and hyper-parameters, the presets and typed reads of a config.json's fields; imports nothing from
the package (reading a whole config.json, and resolving a model name, is models/families.py's: it knows which
family reads it). Sources for the preset numbers: the HF config.json of each checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable


class ModelNameError(ValueError):
    """An unknown model name, HF id or folder; the message says what is accepted."""


@dataclass(frozen=True)
class ModelConfig:
    name: str                          # preset name or folder path, for logs
    family: str                        # a key of models/families.py FAMILIES: "opt", "llama", "qwen2", "mistral"
    n_layers: int
    hidden_size: int                   # model width m
    n_heads: int                       # query heads h
    n_kv_heads: int                    # KV heads g (== n_heads for MHA)
    head_dim: int                      # d
    ffn_size: int
    vocab_size: int
    max_seq_len: int                   # context window the positions were trained for, or a shorter sliding
                                       # window: a longer job is refused rather than run unlike the model
    activation: str = "relu"           # "relu" (OPT) or "silu" (Llama SwiGLU)
    norm: str = "layernorm"            # "layernorm" or "rmsnorm"
    norm_eps: float = 1e-5
    pre_norm: bool = True              # False only for opt-350m (post-LN)
    positions: str = "learned"         # "learned" (OPT, offset 2) or "rope"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None   # e.g. llama3 scaling, as sorted items (hashable)
    tie_word_embeddings: bool = True
    word_embed_dim: int | None = None  # OPT project_in/out width when it differs from hidden_size
    attn_bias: bool = True             # q/k/v biases: OPT and Qwen2 have them, Llama none
    out_bias: bool = True              # the output projection's bias: OPT has it, Llama and Qwen2 none
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
        """K and V bytes one token costs across all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def workspace_bytes(self, batch: int, tokens: int, itemsize: int = 4, score_block_bytes: int = 0) -> int:
        """Estimated transient bytes of the largest single layer forward for `batch` sequences of `tokens` new
        tokens (a prefill chunk is the peak): the layer's output next to its input, plus the attention block
        (q/k/v and output, and when scores are wanted (score_block_bytes > 0: the largest fp32 logits block,
        `ops.score_block_bytes`) that block's logits and probabilities, 4 copies with the allocator's slack)
        or the MLP's ffn-wide intermediates, or the head's last-token logits. Without scores the fused SDPA
        kernel keeps O(tokens) state, not a materialised score matrix. Checked against the OS's peak RSS:
        `tests/memory/test_rss_agreement.py` (`docs/architecture.md` "Memory accounting")."""
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
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.attn_bias else 0) + (h if self.out_bias else 0)
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
    """A Llama-like preset; kw overrides the Llama defaults (family, head_dim, biases, token ids, tying)."""
    fields = dict(family="llama", head_dim=hidden // heads, bos_id=1, eos_id=2, pad_id=None,
                  tie_word_embeddings=False, attn_bias=False, out_bias=False, mlp_bias=False)
    fields.update(kw)
    return ModelConfig(name=name, n_layers=layers, hidden_size=hidden, n_heads=heads, n_kv_heads=kv_heads,
                       ffn_size=ffn, vocab_size=vocab, max_seq_len=ctx, activation="silu", norm="rmsnorm",
                       norm_eps=eps, positions="rope", rope_theta=theta, hf_id=hf_id, **fields)


def _qwen(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, ctx: int,
          eps: float, tied: bool, hf_id: str) -> list[ModelConfig]:
    """A Qwen2 or Qwen2.5 base checkpoint and its -Instruct twin: the same tensors, but the chat model's
    config.json has 32768 positions, rms_norm_eps 1e-6, and ends a turn with <|im_end|> (151645)."""
    base = _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, ctx, 1e6, eps, hf_id, family="qwen2",
                  attn_bias=True, tie_word_embeddings=tied, bos_id=151643, eos_id=151643)
    return [base, base.replace(name=name + "-instruct", hf_id=hf_id + "-Instruct", max_seq_len=32768, norm_eps=1e-6,
                               eos_id=151645)]


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
    *_qwen("qwen2-0.5b", 24, 896, 14, 2, 4864, 151936, 131072, 1e-6, True, "Qwen/Qwen2-0.5B"),
    *_qwen("qwen2-1.5b", 28, 1536, 12, 2, 8960, 151936, 131072, 1e-6, True, "Qwen/Qwen2-1.5B"),
    *_qwen("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, 131072, 1e-6, False, "Qwen/Qwen2-7B"),
    *_qwen("qwen2-72b", 80, 8192, 64, 8, 29568, 152064, 131072, 1e-5, False, "Qwen/Qwen2-72B"),
    *_qwen("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, 32768, 1e-6, True, "Qwen/Qwen2.5-0.5B"),
    *_qwen("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, 131072, 1e-6, True, "Qwen/Qwen2.5-1.5B"),
    *_qwen("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, 32768, 1e-6, True, "Qwen/Qwen2.5-3B"),
    *_qwen("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 131072, 1e-6, False, "Qwen/Qwen2.5-7B"),
    *_qwen("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, 131072, 1e-5, False, "Qwen/Qwen2.5-14B"),
    *_qwen("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, 131072, 1e-5, False, "Qwen/Qwen2.5-32B"),
    *_qwen("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, 131072, 1e-5, False, "Qwen/Qwen2.5-72B"),
    # v0.1 attends over a 4096-token sliding window (of 32768 positions): longer jobs are refused
    _llama("mistral-7b-v0.1", 32, 4096, 32, 8, 14336, 32000, 4096, 1e4, 1e-5, "mistralai/Mistral-7B-v0.1",
           family="mistral"),
    _llama("mistral-7b-v0.3", 32, 4096, 32, 8, 14336, 32768, 32768, 1e6, 1e-5, "mistralai/Mistral-7B-v0.3",
           family="mistral"),
    _llama("mistral-nemo-12b", 40, 5120, 32, 8, 14336, 131072, 1024000, 1e6, 1e-5,
           "mistralai/Mistral-Nemo-Base-2407", family="mistral", head_dim=128),
]}

HF_ID_TO_PRESET: dict[str, str] = {c.hf_id.lower(): n for n, c in PRESETS.items() if c.hf_id}
HF_ID_TO_PRESET.update({"huggingfacetb/smollm2-135m": "smollm2-135m", "meta-llama/llama-2-7b-chat-hf": "llama-2-7b",
                        "meta-llama/llama-2-13b-chat-hf": "llama-2-13b", "meta-llama/llama-2-70b-chat-hf":
                        "llama-2-70b", "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
                        "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
                        # the chat twins of these share their base's config.json
                        "mistralai/mistral-7b-instruct-v0.1": "mistral-7b-v0.1",
                        "mistralai/mistral-7b-instruct-v0.3": "mistral-7b-v0.3",
                        "mistralai/mistral-nemo-instruct-2407": "mistral-nemo-12b"})


# --- reading HF config.json ---

class CheckpointConfigError(ModelNameError):
    """A checkpoint's config.json that cannot be used: unreadable, not JSON, a field missing or of the wrong type,
    an unsupported model_type. The message names the file, the field and what to do."""


_MISSING = object()


class HFFields:
    """Typed reads of an HF config dict; every problem is a CheckpointConfigError naming `where` and the key.
    JSON null counts as absent, as transformers writes null for unset optional fields."""

    def __init__(self, hf: dict[str, Any], where: str, model_type: str) -> None:
        self.hf, self.where, self.model_type = hf, where, model_type

    def get(self, key: str, default: Any, what: str, ok: Callable[[Any], bool]) -> Any:
        value = self.hf.get(key)
        if value is None:
            if default is _MISSING:
                raise CheckpointConfigError(
                    f"{self.where}: field \"{key}\" is missing ({what}, required for model_type "
                    f"\"{self.model_type}\"); add it, with the value from the model's original config.json")
            return default
        if not ok(value):
            raise CheckpointConfigError(f"{self.where}: field \"{key}\" must be {what}, got {json.dumps(value)}; "
                                        "fix it, with the value from the model's original config.json")
        return value

    def int(self, key: str, default: Any = _MISSING) -> int:
        return self.get(key, default, "a positive integer", lambda v: _is_int(v) and v > 0)

    def num(self, key: str, default: Any = _MISSING) -> float:
        return float(self.get(key, default, "a positive number",
                               lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0))

    def flag(self, key: str, default: bool) -> bool:
        return self.get(key, default, "true or false", lambda v: isinstance(v, bool))

    def token(self, key: str, default: Any = None) -> int | None:
        """A token id; eos may be a list of them (Llama 3), of which the first is used."""
        v = self.get(key, default, "a token id (an integer, or a list of them)",
                     lambda v: _is_int(v) or (isinstance(v, list) and bool(v) and all(map(_is_int, v))))
        return v[0] if isinstance(v, list) else v

    def obj(self, key: str) -> dict[str, Any]:
        return dict(self.get(key, {}, "a JSON object", lambda v: isinstance(v, dict)))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def first_set(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default
