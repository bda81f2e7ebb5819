"""The attention function behind H2OCache, registered with transformers' public AttentionInterface.

Fused kernels (sdpa, flash) never expose the attention probabilities, and H2O ranks keys by the attention
mass they receive. So under the name "flexgen_h2o" we register:
- an attention function that computes the output with the engine's own math (models.ops.grouped_attention:
  fp32 softmax, GQA without repeating K/V, per-key mass pooled over each KV head's query heads) and hands the
  mass to the H2OCache layer that produced the keys;
- a mask function (AttentionMaskInterface) that passes the 2D padding mask through untouched: the causal
  pattern over the prompt and the slot validity of the cache are built here, where the slot layout is known.

With any other cache (DynamicCache, or none) the function is plain causal attention, so a model can keep
attn_implementation="flexgen_h2o" for every call.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from flexgen_h2o.hf.cache import ATTN_NAME, claim
from flexgen_h2o.models.ops import grouped_attention


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float, *,
                     q_offset: int = 0, query_valid: Tensor | None = None, want_scores: bool = False,
                     score_reduce: str = "sum", chunk: int = 256, mask4d: Tensor | None = None
                     ) -> tuple[Tensor, Tensor | None]:
    """Causal attention of t queries (at key indices q_offset ...) over s keys, `chunk` queries at a time.

    q (b, h, t, d); k, v (b, g, s, d); key_valid (b, s) bool, False for padding (None = all real); mask4d, a
    caller's own (b, 1 or h, t, s) bool mask, replaces the causal one. Returns out (b, h, t, d) and, if
    want_scores, the fp32 mass per key (b, g, s) summed over the valid queries. The mask and the fp32
    probabilities exist for one chunk at a time: memory ~ b * h * chunk * s, never s * s."""
    t, s = q.shape[2], k.shape[2]
    k, v = k.contiguous(), v.contiguous()    # as in ops.grouped_attention: a head view is copied by every chunk
    key_index = torch.arange(s, device=q.device)
    outs = []
    scores = torch.zeros(k.shape[0], k.shape[1], s, dtype=torch.float32, device=q.device) if want_scores else None
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        # keys past the chunk's last query are causally hidden: leave them out instead of masking them
        hi = s if mask4d is not None else min(s, q_offset + stop)
        if mask4d is not None:
            mask = mask4d[:, :, start:stop]
        else:
            q_index = q_offset + torch.arange(start, stop, device=q.device)[:, None]
            mask = (key_index[:hi] <= q_index)[None, None]                         # (1, 1, tc, hi)
            if key_valid is not None:
                # a pad query still sees itself, so no softmax row is empty (its output is never used)
                mask = (mask & key_valid[:, None, None, :hi]) | (key_index[:hi] == q_index)[None, None]
        qv = None if query_valid is None else query_valid[:, start:stop]
        if want_scores:
            out, sc = _scored_chunk(q[:, :, start:stop], k[:, :, :hi], v[:, :, :hi], mask, scale, qv, score_reduce)
            scores[:, :, :hi] += sc
        else:                                # nobody needs the mass: the fused kernel
            out, _ = grouped_attention(q[:, :, start:stop], k[:, :, :hi], v[:, :, :hi], mask, scale)
        outs.append(out)
    return (torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]), scores


def _scored_chunk(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, query_valid: Tensor | None,
                  score_reduce: str) -> tuple[Tensor, Tensor]:
    """grouped_attention's math for one block of queries, in fewer passes over the (b, h, tc, s) block: the
    scale goes on q, the mask is filled in place, and the column sums are one matmul with the query weights
    instead of a masked copy plus a reduction (the prompt is where the scoring cost is). -> out, mass (b, g, s)."""
    b, h, tc, d = q.shape
    g, s = k.shape[1], k.shape[2]
    r = h // g
    logits = torch.matmul((q * scale).reshape(b, g, r * tc, d), k.transpose(-1, -2)).view(b, g, r, tc, s)
    probs = torch.softmax(logits.float().masked_fill_(~mask[:, :, None], float("-inf")), dim=-1)
    probs = probs.view(b, g, r * tc, s)                                            # fp32
    out = torch.matmul(probs.to(v.dtype), v).view(b, h, tc, d)
    weight = torch.ones(b, tc, device=q.device) if query_valid is None else query_valid.float()
    weight = weight[:, None, None, :].expand(b, g, r, tc).reshape(b, g, 1, r * tc)
    mass = torch.matmul(weight, probs).squeeze(2)                                  # pads' rows weigh 0
    return out, (mass / r if score_reduce == "mean" else mass)


def _as_bool_mask(mask: Tensor) -> Tensor:
    # an additive float mask (0 = attend, dtype min = hidden) becomes a boolean one
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def h2o_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """transformers attention-function signature. query (b, h, t, d); key, value (b, g, s, d) as returned by the
    cache; attention_mask: the 2D padding mask from `padding_mask` below (or a caller's 4D mask).
    Returns (output (b, t, h, d), per-key attention mass (b, g, s) fp32 when the cache needed it, else None)."""
    if dropout:
        raise ValueError("the flexgen_h2o attention is for inference only: call model.eval() (dropout must be 0)")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    b, t, s = query.shape[0], query.shape[2], key.shape[2]
    mask4d = _as_bool_mask(attention_mask) if attention_mask is not None and attention_mask.dim() == 4 else None
    pad = attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 2 else None
    layer = claim(key)
    if layer is None:                        # not an H2OCache: plain causal attention over what we were given
        if pad is not None and pad.shape[-1] != s:
            raise ValueError(f"attention_mask covers {pad.shape[-1]} tokens but there are {s} keys")
        out, _ = prompt_attention(query, key, value, pad, scale, q_offset=s - t, mask4d=mask4d)
        return out.transpose(1, 2).contiguous(), None
    if mask4d is not None:
        raise ValueError("H2OCache needs the 2D attention_mask (1 = token, 0 = padding), not a 4D mask")
    owner = layer.owner
    if layer.store is None:                     # the prompt: its slots are made when attention has scored it
        valid = torch.ones(b, t, dtype=torch.bool, device=query.device) if pad is None else pad[:, -t:]
        out, mass = prompt_attention(query, key, value, valid, scale, query_valid=valid,
                                     want_scores=layer.needs_scores, score_reduce=owner.eviction.score_reduce,
                                     chunk=owner.query_chunk)
        layer.commit_prefill(mass, valid)
    else:
        # one new token over the slot window: kept tokens + itself; free slots are masked out
        out, mass = grouped_attention(query, key, value, layer.slot_mask()[:, :, None, :], scale,
                                      want_scores=layer.needs_scores, score_reduce=owner.eviction.score_reduce)
        layer.commit_decode(mass)
    return out.transpose(1, 2).contiguous(), mass


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Any = None, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """AttentionMaskInterface entry: the 2D (b, kv_length) padding mask as is, or None when nothing is padded."""
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    return mask[:, kv_offset:kv_offset + kv_length] if mask.shape[-1] > kv_length else mask


def register() -> None:
    """Register the attention and mask functions under ATTN_NAME (done on import of flexgen_h2o.hf)."""
    AttentionInterface.register(ATTN_NAME, h2o_attention)
    AttentionMaskInterface.register(ATTN_NAME, padding_mask)


def enable_h2o(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a loaded transformers model to the flexgen_h2o attention (needed by H2OCache); returns it."""
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
                         f"so H2OCache cannot get attention scores from it")
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in types) or (not types and getattr(cfg, "sliding_window", None)
                                                     and getattr(cfg, "use_sliding_window", True)):
        # the function builds a plain causal mask: a sliding-window layer would silently see too much
        raise ValueError(f"{type(model).__name__} has sliding-window or non-standard attention layers; the "
                         f"flexgen_h2o attention supports full causal attention only")
    model.set_attn_implementation(ATTN_NAME)
    if model.config._attn_implementation != ATTN_NAME:
        raise ValueError(f"{type(model).__name__} refused attn_implementation={ATTN_NAME!r}")
    return model
