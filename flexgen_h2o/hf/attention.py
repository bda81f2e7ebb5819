"""The attention function behind H2OCache, registered with transformers' public AttentionInterface.

Fused kernels (sdpa, flash) never expose the attention probabilities, and H2O ranks keys by the attention
mass they receive. So under the name "flexgen_h2o" we register:
- an attention function that computes the output and each key's mass with the engine's own entry points, the
  cache's Kernels (flexgen_h2o.kernels, resolved once per cache): prompt_attention for the prompt, and for a
  decode step window_attention, which the engine's decode_attention calls for a window staged in compute dtype.
  So the HF path takes the compiled kernels on a CPU and the torch ops elsewhere, as the engine does
  (kernels/dispatch.py), and hands the mass to the H2OCache layer that produced the keys;
- a mask function (AttentionMaskInterface) that passes the 2D padding mask through untouched: the causal
  pattern over the prompt and the slot validity of the cache are built here, where the slot layout is known.

With any other cache (DynamicCache, or none) the function is plain causal attention through the same entry
points (Kernels resolved once per process), so a model can keep attn_implementation="flexgen_h2o" for every call,
and an H2OCache that never evicts gives what a DynamicCache gives, bit for bit.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from flexgen_h2o.hf.cache import ATTN_NAME, claim
from flexgen_h2o.kernels import resolve
from flexgen_h2o.models.layer import StepContext
from flexgen_h2o.models.ops import TORCH, TorchKernels, grouped_attention


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float, *, want_scores: bool = False,
                     score_reduce: str = "sum", chunk: int = 256, kernels: TorchKernels = TORCH,
                     score_window: int | None = None) -> tuple[Tensor, Tensor | None]:
    """A prompt attending to itself (causal, pads hidden) through kernels.prompt_attention, the engine's entry point.

    q (b, h, t, d); k, v (b, g, t, d); valid (b, t) bool, False for padding. Returns out (b, h, t, d) and, if
    want_scores, the fp32 mass per key (b, g, t) summed over the valid queries, or the last score_window ones
    (mean: over a KV head's query heads). chunk: the queries per block of the torch path (memory ~ b * h * chunk
    * t, never t * t)."""
    # a window is the last rows of the padded batch (ops.score_start): the last real tokens only with left padding
    if score_window is not None and not bool((valid[:, 1:] >= valid[:, :-1]).all()):
        raise ValueError("score_window scores keys by a prompt's last tokens: pad prompts on the left "
                         "(tokenizer.padding_side = 'left')")
    pad_counts = StepContext.leading_pads(valid) if valid.device.type == "cpu" else None
    ctx = StepContext(positions=torch.where(valid, valid.long().cumsum(-1) - 1, -1), token_valid=valid,
                      compute_dtype=q.dtype, want_scores=want_scores, score_reduce=score_reduce, query_chunk=chunk,
                      unpadded=bool(valid.all()), pad_counts=pad_counts, score_window=score_window)
    return kernels.prompt_attention(q, k, v, ctx, scale)


@functools.cache
def plain_kernels() -> TorchKernels:
    """The Kernels for caches other than H2OCache (which resolves its own), resolved once per process."""
    return resolve()


def plain_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float,
                    mask4d: Tensor | None = None) -> Tensor:
    """Any other cache's attention, output only: a prompt over itself and one new token over the cache go to the
    entry points an H2OCache's calls take (prompt_attention, window_attention); a caller's 4D mask, or several new
    tokens over a filled cache, to causal_attention. key_valid (b, s) bool, False for padding (None = all real)."""
    b, t, g, s = q.shape[0], q.shape[2], k.shape[1], k.shape[2]
    if mask4d is None and t in (1, s):
        valid = torch.ones(b, s, dtype=torch.bool, device=q.device) if key_valid is None else key_valid
        if t == s:
            return prompt_attention(q, k, v, valid, scale, kernels=plain_kernels())[0]
        valid = valid[:, None, :].expand(b, g, s).clone()
        valid[:, :, -1] = True                     # the new token sees itself, as any decode step's does
        slot = torch.full((b, g), s - 1, dtype=torch.long, device=q.device)
        return plain_kernels().window_attention(q, k, v, valid, slot, scale)[0]
    return causal_attention(q, k, v, key_valid, scale, q_offset=s - t, mask4d=mask4d)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float, *, q_offset: int = 0,
                     mask4d: Tensor | None = None, chunk: int = 256) -> Tensor:
    """Causal attention, output only: t queries (at key indices q_offset ...) over s keys, `chunk` queries at a
    time through ops.grouped_attention's fused path. key_valid (b, s) bool, False for padding (None = all real);
    mask4d, a caller's own (b, 1 or h, t, s) bool mask, replaces the causal one."""
    t, s = q.shape[2], k.shape[2]
    key_index = torch.arange(s, device=q.device)
    outs = []
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
        outs.append(grouped_attention(q[:, :, start:stop], k[:, :, :hi], v[:, :, :hi], mask, scale)[0])
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


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
        return plain_attention(query, key, value, pad, scale, mask4d).transpose(1, 2).contiguous(), None
    if mask4d is not None:
        raise ValueError("H2OCache needs the 2D attention_mask (1 = token, 0 = padding), not a 4D mask")
    owner = layer.owner
    reduce = owner.eviction.score_reduce
    if layer.store is None:                     # the prompt: its slots are made when attention has scored it
        valid = torch.ones(b, t, dtype=torch.bool, device=query.device) if pad is None else pad[:, -t:]
        out, mass = prompt_attention(query, key, value, valid, scale, want_scores=layer.needs_scores,
                                     score_reduce=reduce, chunk=owner.query_chunk, kernels=owner.kernels,
                                     score_window=owner.eviction.score_window)
        layer.commit_prefill(mass, valid)
    else:
        pages = layer.select(query)
        if pages is not None:         # page selection: the new token over the pages its query needs
            view, k_new, v_new = pages
            ctx = StepContext(positions=layer.next_pos.view(-1, 1), token_valid=torch.ones(b, 1, dtype=torch.bool),
                              compute_dtype=query.dtype, kernels=owner.kernels)
            out, mass = owner.kernels.decode_attention(query, k_new, v_new, view, ctx, scale)
        else:
            # one new token over the slot window (kept tokens + itself, which update() wrote into its free slot)
            out, mass = owner.kernels.window_attention(query, key, value, layer.slot_mask(), layer.write_slot,
                                                       scale, want_scores=layer.needs_scores, score_reduce=reduce)
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
