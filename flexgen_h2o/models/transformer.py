"""The four layer kinds of a decoder (embed, attention, MLP, head), shared by OPT and Llama.

A family module (opt.py, llama.py) supplies the weight names; the ModelConfig switches the few real differences
(learned vs rotary positions, LayerNorm vs RMSNorm, pre- vs post-LN, biases, ReLU vs SwiGLU, project_in/out).
Each forward is a pure function of (x, staged weights, KV view, StepContext).
"""
from __future__ import annotations

import functools
from typing import Mapping

from torch import Tensor

from flexgen_h2o.models import ops
from flexgen_h2o.models.config import ModelConfig
from flexgen_h2o.models.layer import KVSpec, KVView, LayerOutput, StepContext, WeightSpec


class _Base:
    kind = ""

    def __init__(self, name: str, cfg: ModelConfig, specs: list[WeightSpec], norm: str | None = None):
        """norm: the weight-name prefix of the layer's norm, which each family names its own way."""
        self.name = name
        self.cfg = cfg
        self._specs = specs
        self.norm = norm

    def weight_specs(self) -> list[WeightSpec]:
        return list(self._specs)

    def kv_spec(self) -> KVSpec | None:
        return None

    def _norm(self, x: Tensor, w: Mapping[str, Tensor], prefix: str, ctx: StepContext) -> Tensor:
        if self.cfg.norm == "rmsnorm":
            return ctx.kernels.rms_norm(x, w[prefix + ".weight"], self.cfg.norm_eps)
        return ops.layer_norm(x, w[prefix + ".weight"], w[prefix + ".bias"], self.cfg.norm_eps)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class EmbedLayer(_Base):
    """Token ids (b, t) -> hidden (b, t, m). OPT adds learned positions (table offset 2) after project_in."""
    kind = "embed"

    def forward(self, x: Tensor, w: Mapping[str, Tensor], kv: KVView | None, ctx: StepContext) -> LayerOutput:
        h = ops.embedding(x, w["embed_tokens.weight"]).to(ctx.compute_dtype)
        if "project_in.weight" in w:
            h = ctx.kernels.linear(h, w["project_in.weight"])
        if self.cfg.positions == "learned":
            # pads sit at position -1 -> table row 1, as HF's cumsum(mask) * mask - 1 + 2
            pos = ops.embedding(ctx.positions.clamp(min=-1) + 2, w["embed_positions.weight"]).to(ctx.compute_dtype)
            h = h + pos
        return LayerOutput(hidden=h)


@functools.lru_cache(maxsize=8)
def _inv_freq(cfg: ModelConfig) -> Tensor:
    """RoPE's frequencies, one tensor per model shared by its layers (read only), so that a step's cos and sin,
    computed once (StepContext.rope), are found by identity."""
    return ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)


class AttentionLayer(_Base):
    """Self-attention with its norm and residual. Writes the new token into the staged KV view, then attends."""
    kind = "attn"

    def __init__(self, name: str, cfg: ModelConfig, specs: list[WeightSpec], out_proj: str, norm: str):
        super().__init__(name, cfg, specs, norm)
        self.out_proj = out_proj
        self.inv_freq = _inv_freq(cfg) if cfg.positions == "rope" else None

    def kv_spec(self) -> KVSpec:
        return KVSpec(self.cfg.n_kv_heads, self.cfg.head_dim)

    def _proj(self, h: Tensor, w: Mapping[str, Tensor], which: str, ctx: StepContext) -> Tensor:
        return ctx.kernels.linear(h, w[f"self_attn.{which}.weight"], w.get(f"self_attn.{which}.bias"))

    def _rotate(self, t: Tensor, ctx: StepContext) -> Tensor:
        if self.inv_freq is None:
            return t
        cos, sin = ctx.rope(self.inv_freq, t.dtype)                             # (b, 1, t, d), once a step
        return ctx.kernels.apply_rope(t, cos, sin)

    def _heads(self, hl: Tensor, b: int, w: Mapping[str, Tensor], which: str, n: int, ctx: StepContext) -> Tensor:
        """One projection of the live rows hl, spread back to the b rows, as (b, n, t, d)."""
        return ops.split_heads(ctx.spread(self._proj(hl, w, which, ctx), b), n)

    def query(self, x: Tensor, w: Mapping[str, Tensor], ctx: StepContext) -> Tensor:
        """The rotated query (b, h, t, d) this layer makes of hidden state x: for reading pages a layer ahead,
        from the previous layer's input (schedule/executor.py _read_ahead)."""
        h = self._norm(x, w, self.norm, ctx) if self.cfg.pre_norm else x
        return self._rotate(self._heads(ctx.take_live(h), h.shape[0], w, "q_proj", self.cfg.n_heads, ctx), ctx)

    def forward(self, x: Tensor, w: Mapping[str, Tensor], kv: KVView | None, ctx: StepContext) -> LayerOutput:
        cfg, kernels = self.cfg, ctx.kernels
        h = self._norm(x, w, self.norm, ctx) if cfg.pre_norm else x
        hl, b = ctx.take_live(h), h.shape[0]    # a refilled block's free rows skip the projections
        q = self._rotate(self._heads(hl, b, w, "q_proj", cfg.n_heads, ctx), ctx)             # (b, h, t, d)
        k = self._heads(hl, b, w, "k_proj", cfg.n_kv_heads, ctx)                             # (b, g, t, d)
        v = self._heads(hl, b, w, "v_proj", cfg.n_kv_heads, ctx)                             # (b, g, t, d)
        k_store = k
        if self.inv_freq is not None:
            k = self._rotate(k, ctx)
            if not ctx.keys_pre_rope:
                k_store = k                      # cache holds keys rotated at their true positions
        scale = cfg.head_dim ** -0.5
        if kv is None:
            # prompt: the new tokens attend among themselves (real positions in both position modes), with each
            # key's mass where the rule wants it
            out, scores = kernels.prompt_attention(q, k, v, ctx, scale)
        else:
            if kv.select is not None:        # the cache reads the pages this query needs (kv/pages.py)
                kv = kv.select(q)
            if kv.k.device != q.device:      # attention where the KV was staged (cpu_cache_compute)
                q, k_store, v = (t.to(kv.k.device, kv.compute_dtype or kv.k.dtype) for t in (q, k_store, v))
            out, scores = kernels.decode_attention(q, k_store, v, kv, ctx, scale, self.inv_freq)
        return self._finish(x, out, w, k_store, v, scores, ctx)

    def _finish(self, x: Tensor, out: Tensor, w: Mapping[str, Tensor], k_store: Tensor, v: Tensor,
                scores: Tensor | None, ctx: StepContext) -> LayerOutput:
        """Output projection and residual; only the attention output crosses back to x's device."""
        out = ctx.take_live(out.to(x.device, x.dtype))
        out = ctx.kernels.linear(ops.merge_heads(out), w[f"self_attn.{self.out_proj}.weight"],
                                 w.get(f"self_attn.{self.out_proj}.bias"))
        x = x + ctx.spread(out, x.shape[0])
        if not self.cfg.pre_norm:
            x = self._norm(x, w, self.norm, ctx)
        return LayerOutput(hidden=x, k_new=k_store, v_new=v, scores=scores)


class MLPLayer(_Base):
    """Feed-forward block with its norm and residual: ReLU (OPT) or SwiGLU (Llama)."""
    kind = "mlp"

    def forward(self, x: Tensor, w: Mapping[str, Tensor], kv: KVView | None, ctx: StepContext) -> LayerOutput:
        kernels = ctx.kernels
        h = ctx.take_live(self._norm(x, w, self.norm, ctx) if self.cfg.pre_norm else x)
        if self.cfg.activation == "silu":
            out = kernels.swiglu_mlp(h, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])
        else:
            out = kernels.relu_mlp(h, w["fc1.weight"], w.get("fc1.bias"), w["fc2.weight"], w.get("fc2.bias"))
        x = x + ctx.spread(out, x.shape[0])
        if not self.cfg.pre_norm:
            x = self._norm(x, w, self.norm, ctx)
        return LayerOutput(hidden=x)


class HeadLayer(_Base):
    """Final norm, project_out (opt-350m) and the output projection: logits in fp32."""
    kind = "head"

    def forward(self, x: Tensor, w: Mapping[str, Tensor], kv: KVView | None, ctx: StepContext) -> LayerOutput:
        rows = x.shape[0]
        x = ctx.take_live(x[:, -1:])             # left padding puts every sequence's last token at the end
        if self.cfg.final_norm:
            x = self._norm(x, w, self.norm, ctx)
        if "project_out.weight" in w:
            x = ctx.kernels.linear(x, w["project_out.weight"])
        # a resident tied table stays fp16: upcast by rows
        logits = ctx.kernels.linear(x, w["lm_head.weight"]).float()
        return LayerOutput(hidden=ctx.spread(logits[:, 0], rows))


def all_specs(layers: list) -> list[WeightSpec]:
    """Every distinct tensor of a model (a tied embedding appears once)."""
    seen: dict[str, WeightSpec] = {}
    for layer in layers:
        for spec in layer.weight_specs():
            seen.setdefault(spec.name, spec)
    return list(seen.values())


def schedule_groups(kinds: list[str], sep_layer: bool) -> list[list[int]]:
    """Schedule layers from the layer kinds: every model layer alone, or an attention layer with its MLP."""
    groups: list[list[int]] = []
    for i, kind in enumerate(kinds):
        if not sep_layer and kind == "mlp" and groups and kinds[groups[-1][-1]] == "attn":
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
