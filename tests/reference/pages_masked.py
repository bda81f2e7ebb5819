"""Slow, obviously-correct reference for page selection: an HF model with its full KV cache, each decode step's
query hidden from every key outside the pages it chooses.

Nothing here imports flexgen_h2o: the rule is re-derived in plain Python from its contract (docs/page-selection.md):
- a sequence's real tokens, in order, fall into pages of `page_size`: token n is on page n // page_size;
- a page's summary is the per-channel min and max of its committed keys (the step's own new key is not one yet);
- at a decode step with n tokens held plus the new one, the sequence has ceil((n + 1) / P) pages and reads
  min(that, max(want, sinks + recents)) of them, want = fetch_pages or ceil(int(fetch_ratio * (n + 1)) / P);
- per KV head, the first `sink_pages` and the last `recent_pages` pages are read; the rest are ranked, ties to
  the lower page, and the best fill the count. Score "bound": the largest over the group's query heads of
  sum_c max(q_c * min_c, q_c * max_c) (float64 here). Score "keys": the page's largest key_mass, the attention
  the group's query heads give each held key read back from int4;
- the query attends to every token of the pages read and to itself; the prompt pass attends to everything, and
  so does every step of the first `dense_layers` layers;
- `ahead`: a layer after the first chooses by another query, the one its attention makes (its norm, q_proj,
  RoPE) of the previous layer's MLP input (the residual after the previous attention); it still attends with
  its own.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from tests.reference.fake_quant import fake_quant
from tests.reference.masks import grouped_masked_attention, prompt_allowed, real_positions

ATTN_NAME = "page_selection_reference"
STATE_ATTR = "_page_reference_state"


class _State:
    def __init__(self, attention_mask: torch.Tensor, rule: dict):
        self.rule = rule
        self.phase = "prefill"
        self.pos = real_positions(attention_mask)     # per sequence, per cache index; -1 for pads
        self.chosen: dict[int, list] = {}          # layer -> per step: [b][g] sorted pages read
        self.mlp_input: dict[int, torch.Tensor] = {}     # layer -> this step's MLP input (ahead)
        self.ahead_query: dict[int, torch.Tensor] = {}   # layer -> the query it chooses by (ahead)

    def pages_read(self, n_tokens: int) -> int:
        P = self.rule["page_size"]
        have = -(-n_tokens // P)
        want = (self.rule["fetch_pages"] if self.rule.get("fetch_pages") is not None
                else -(-int(self.rule["fetch_ratio"] * n_tokens) // P))
        return min(have, max(want, self.rule["sink_pages"] + self.rule["recent_pages"]))


def key_mass(queries: torch.Tensor, keys: torch.Tensor) -> list[float]:
    """The "keys" score's attention per held key: keys (n, d) read back from int4 (fake_quant, one group per
    head), each query head's softmax over them and a zero key (the step's own row), summed over the heads."""
    approx = fake_quant(keys.float(), 4, 64).double()
    total = torch.zeros(keys.shape[0], dtype=torch.float64)
    for q in queries:
        logits = torch.cat([approx @ q.double() * keys.shape[1] ** -0.5, torch.zeros(1, dtype=torch.float64)])
        total += torch.softmax(logits, dim=0)[:-1]
    return total.tolist()


def choose(st: _State, queries: torch.Tensor, keys: torch.Tensor, positions: list[int]) -> list[int]:
    """The pages one KV head reads: queries (r, d) of its group, keys (L, d) of the cache with their positions
    (-1: a pad); the last cache index is the new token."""
    P, sinks, recents = st.rule["page_size"], st.rule["sink_pages"], st.rule["recent_pages"]
    n = positions[-1]                                 # tokens held before the new one
    filled = -(-(n + 1) // P)
    members: dict[int, list[int]] = {}
    for i, p in enumerate(positions[:-1]):
        if p >= 0:
            members.setdefault(p // P, []).append(i)
    held = [i for i, p in enumerate(positions[:-1]) if p >= 0]
    mass = dict(zip(held, key_mass(queries, keys[held]))) if st.rule.get("score") == "keys" else {}
    ranked = []
    for j in range(filled):
        forced = j < sinks or j >= filled - recents
        if forced:
            ranked.append((0, 0.0, j))
            continue
        if mass:                                   # the page's best token
            ranked.append((1, -max(mass[i] for i in members[j]), j))
            continue
        page_keys = keys[members[j]].double()
        lo, hi = page_keys.min(dim=0).values, page_keys.max(dim=0).values
        bound = max(float(torch.maximum(q.double() * lo, q.double() * hi).sum()) for q in queries)
        ranked.append((1, -bound, j))
    ranked.sort()
    return sorted(j for _, _, j in ranked[:st.pages_read(n + 1)])


def masked_page_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """query (b, h, q, d); key, value (b, g, L, d), the full history. HF's mask is ignored: ours is built here."""
    st = getattr(module, STATE_ATTR, None)
    assert st is not None, "masked_page_attention runs only inside page_reference_generate"
    b, h, q, d = query.shape
    g, L = key.shape[1], key.shape[2]
    r = h // g
    scale = d ** -0.5 if scaling is None else scaling
    if st.phase == "capture":                       # only the query is wanted (_capture_ahead)
        st.ahead_query[module.layer_idx] = query.detach().clone()
        return torch.zeros_like(query).transpose(1, 2), None
    allowed = torch.zeros(b, g, q, L, dtype=torch.bool)
    if st.phase == "prefill":
        allowed = prompt_allowed(st.pos, g, q, L)
    elif module.layer_idx < st.rule.get("dense_layers", 0):      # a dense layer: every key, as the full cache
        allowed[:] = torch.tensor([[p >= 0 for p in plist[:L - 1]] + [True] for plist in st.pos])[:, None, None, :]
    else:
        step = []
        P = st.rule["page_size"]
        chooser = st.ahead_query.pop(module.layer_idx, query)
        for bi in range(b):
            per_head = []
            for gi in range(g):
                pages = choose(st, chooser[bi, gi * r:(gi + 1) * r, 0], key[bi, gi], st.pos[bi][:L])
                per_head.append(pages)
                for i, p in enumerate(st.pos[bi][:L]):
                    allowed[bi, gi, 0, i] = p >= 0 and (i == L - 1 or p // P in pages)
            step.append(per_head)
        st.chosen.setdefault(module.layer_idx, []).append(step)
    out, probs, _ = grouped_masked_attention(query, key, value, allowed, scale)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register(ATTN_NAME, masked_page_attention)


def _hook_ahead(model: torch.nn.Module, state: _State) -> list:
    """Forward hooks for `ahead` (pre-norm models): each decoder layer's MLP norm records its input, and before a
    decode step's layer n > max(0, dense_layers - 1) runs, its attention is run on layer n - 1's recorded input,
    through its own input norm, in the "capture" phase that keeps the query (without touching the cache)."""
    layers = list(model.model.layers if hasattr(model.model, "layers") else model.model.decoder.layers)
    handles = []
    for n, layer in enumerate(layers):
        mlp_norm = getattr(layer, "post_attention_layernorm", None) or layer.final_layer_norm
        attn_norm = getattr(layer, "input_layernorm", None) or layer.self_attn_layer_norm

        def record(module, args, n=n):
            state.mlp_input[n] = args[0].detach()
        handles.append(mlp_norm.register_forward_pre_hook(record))
        if n == 0 or n < state.rule.get("dense_layers", 0):
            continue

        def capture(module, args, kwargs, n=n, attn_norm=attn_norm):
            if state.phase != "decode":
                return
            state.phase = "capture"
            try:
                shape = (args[0] if args else kwargs["hidden_states"]).shape          # OPT's MLP input is 2-d
                extra = {k: v for k, v in kwargs.items()
                         if k not in ("hidden_states", "past_key_values", "cache", "use_cache")}
                module.self_attn(hidden_states=attn_norm(state.mlp_input[n - 1].reshape(shape)), **extra)
            finally:
                state.phase = "decode"
        handles.append(layer.register_forward_pre_hook(capture, with_kwargs=True))
    return handles


@torch.no_grad()
def page_reference_generate(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            rule: dict, max_new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
    """Greedy generation with page selection. input_ids, attention_mask (b, p) left-padded; rule: page_size,
    fetch_ratio or fetch_pages, sink_pages, recent_pages, dense_layers, score, ahead. Returns tokens (b, n), the logits (b, V) that chose each,
    and per layer the pages each decode step read, [step][b][g] -> sorted page indices."""
    mask = attention_mask.long()
    b = input_ids.shape[0]
    state = _State(mask, rule)
    old_impl, was_training = model.config._attn_implementation, model.training
    model.config._attn_implementation = ATTN_NAME
    model.eval()
    modules = [m for m in model.modules() if hasattr(m, "layer_idx")]
    for m in modules:
        setattr(m, STATE_ATTR, state)
    hooks = _hook_ahead(model, state) if rule.get("ahead") else []
    tokens, step_logits = [], []
    try:
        position_ids = torch.tensor(state.pos).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
        state.phase = "decode"
        for step in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            step_logits.append(logits)
            nxt = logits.argmax(dim=-1)
            tokens.append(nxt)
            if step == max_new_tokens - 1:
                break
            for plist in state.pos:
                plist.append(1 + max(plist))
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
            position_ids = torch.tensor([[plist[-1]] for plist in state.pos])
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=position_ids,
                        past_key_values=out.past_key_values, use_cache=True)
    finally:
        for handle in hooks:
            handle.remove()
        for m in modules:
            delattr(m, STATE_ATTR)
        model.config._attn_implementation = old_impl
        model.train(was_training)
    return torch.stack(tokens, dim=1), step_logits, state.chosen
