"""Slow, obviously-correct H2O reference: an HF model with its FULL KV cache and eviction simulated by masks.

Nothing here imports flexgen_h2o: the rule is re-derived with plain Python lists and sets, and the attention
is transformers' own model with one swapped attention function, so this file can catch bugs in both the
engine's math and its vectorised policies.

How it works: `reference_generate` runs the model step by step (greedy) with a DynamicCache that never drops
anything. Our attention function (registered with transformers' AttentionInterface) builds its own mask per
(sequence, KV head) from a Python set of kept cache indices, and hides evicted keys from every query head of
that KV head's group. Scores follow the engine's contract (flexgen_h2o/kv/h2o.py):
- prefill: full causal attention over the real prompt tokens; score of a key = sum over the real queries and
  over the group's query heads ("sum") or that divided by the group size ("mean"); then keep the sinks, the
  `recent` newest real tokens and the `heavy` best-scored others (ties keep the larger position);
- decode: the new token joins the kept set with score 0, attends to the kept set, every kept key's score gets
  this step's probability; if more than sink + heavy + recent are kept, one victim is dropped:
  exact = lowest score among the non-sink, non-recent kept tokens (ties: smallest position); port = the same
  after always admitting the newest of those (the token leaving the window); window = the oldest non-sink;
  avg = exact, ranking by score / the number of queries that attended to the key. That count is kept here as
  its own tally of the mask (every query row that was allowed to see the key), not derived from positions.
- a score window (score_window n): the prompt's scores come from its last n real queries only.
- snapkv: the prompt is ranked by h2o_rule.ref_window_pooled (the window's mass averaged over pool_kernel
  neighbouring keys, the window's own keys first), a kept key's score starts from that pooled mass (the window's
  keys from their own), and decode steps are the exact rule.
- tova: a key's score is the last forward's mass only (replaced, not added), and every choice ranks by the
  sum over the sequence's KV heads, so all heads of a layer keep the same tokens.
- position rolling (RoPE models): at a decode step every kept key is re-rotated to its rank among the kept
  tokens of its (sequence, KV head), and the query to the new token's rank (the number of tokens kept before
  it). HF has already rotated both at their true positions; RoPE is a rotation, so turning a vector by
  (rank - true position) lands it exactly at its rank.
- a compressed cache (kv_bits): at a decode step every earlier token's key and value are read as they would
  come back from group-wise min-max quantization along head_dim (fake_quant); keys are divided by a per-channel
  scale first (each channel's largest |k| over the sequence's real prompt tokens) and multiplied back after.
  The new token attends to its own unrounded row. With rolling the cache holds keys before RoPE, so a key is
  turned back to position 0 (scale included), rounded and turned forward again. The prompt pass attends among
  unrounded rows.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from tests.reference.fake_quant import fake_quant
from tests.reference.masks import grouped_masked_attention, prompt_allowed, real_positions
from tests.reference.rolling import roll_to_ranks, rotate
from tests.reference.h2o_rule import (prefill_candidates, ref_adaptive_keep, ref_keep_prefill, ref_victim,
                                      ref_window_pooled, victim_candidates)

ATTN_NAME = "h2o_reference_masked"
NEAR_TIE = 3e-7         # a compressed cache's rounding this close to a boundary may go either way (fake_quant)
RULES = ("exact", "port", "window", "avg", "full", "snapkv", "tova")
# which reference rule checks which flexgen_h2o eviction policy (random has no deterministic reference)
RULE_FOR_POLICY = {"h2o": "exact", "h2o-port": "port", "h2o-avg": "avg", "local": "window", "sink": "window",
                   "full": "full", "snapkv": "snapkv", "tova": "tova"}

STATE_ATTR = "_h2o_reference_state"   # set on every attention module for the duration of a run


# --- the simulated cache ---

def stored_history(st: "_RefState", key: torch.Tensor, value: torch.Tensor):
    """key, value (b, g, L, d) with every row but the newest (index L - 1) as a compressed cache reads it back."""
    bits, group = st.kv_bits
    key, value = key.clone(), value.clone()
    margins: list = []
    value[:, :, :-1] = fake_quant(value[:, :, :-1], bits, group, margins)
    old = key[:, :, :-1]
    pos = torch.tensor([plist[:old.shape[2]] for plist in st.pos])[:, None, :].expand(old.shape[:3])
    if st.inv_freq is not None:
        old = rotate(old, -pos.clamp(min=0), st.inv_freq)              # as stored: before RoPE
    width = st.prompt_width
    real = (pos[:, :, :width] >= 0)[..., None]
    scale = torch.where(real, old[:, :, :width].abs(), torch.zeros(())).amax(dim=2, keepdim=True).clamp(min=1e-30)
    st.last_key_input = old / scale                 # the key quantizer's input (before RoPE when rolling)
    old = fake_quant(st.last_key_input, bits, group, margins) * scale
    if st.inv_freq is not None:
        old = rotate(old, pos.clamp(min=0), st.inv_freq)
    key[:, :, :-1] = old
    st.last_scale = scale
    step = len(st.pos[0]) - st.prompt_width              # the decode step whose logits these rows give
    least = torch.where(pos >= 0, torch.minimum(*margins), 0.5)          # pads are never read
    for b, margin in enumerate(least.flatten(1).amin(1).tolist()):
        if margin < NEAR_TIE and st.near_tie[b] is None:
            st.near_tie[b] = step
    return key, value


class _RefState:
    def __init__(self, attention_mask: torch.Tensor, budgets: list[tuple[int, int, int]], rule: str,
                 score_reduce: str, max_len: int, inv_freq: torch.Tensor | None = None):
        self.budgets, self.rule = budgets, rule          # per sequence: (sink, heavy, recent)
        self.inv_freq = inv_freq                  # set: position rolling
        self.score_reduce = score_reduce
        self.max_len = max_len
        self.score_window: int | None = None     # the prompt's last real queries that score its keys
        self.head_floor: float | None = None     # set: head-adaptive budgets, each head's heavy count its own
        self.head_heavy: dict[tuple[int, int], list[int]] = {}    # (layer, b) -> per KV head
        self.pool_kernel = 1
        self.phase = "prefill"
        self.decode_mass = True          # False: decode steps add nothing (what a broken cache would do)
        self.flip_ties = False           # True: equal scores resolved the wrong way round
        self.kv_bits: tuple[int, int] | None = None     # (bits, group size): a compressed cache
        self.prompt_width = attention_mask.shape[1]     # cache indices below it are the (padded) prompt's
        self.near_tie: list[int | None] = [None] * attention_mask.shape[0]  # per sequence: see reference_generate
        self.quant_log: dict | None = None         # a dict: see reference_generate's quant_log
        self.last_scale: torch.Tensor | None = None
        self.last_key_input: torch.Tensor | None = None
        # per sequence: the least |a - b| / (a + b) of the two ranking scores closest across each forward's eviction
        # choices (index 0 the prompt pass, t the decode step whose logits are t), and the largest sum |q k| scale
        # of any attention logit (what a path's logit rounding is relative to): see tolerances.eviction_tie_step
        self.gaps: list[list[float]] = [[] for _ in range(attention_mask.shape[0])]
        self.attn_mag = 0.0
        # per sequence, per cache index: the token's position among the sequence's real tokens, -1 for pads
        self.pos: list[list[int]] = real_positions(attention_mask)
        self.keep: dict[int, list[list[set[int]]]] = {}       # layer -> [b][g] -> kept cache indices
        self.score: dict[int, torch.Tensor] = {}              # layer -> (b, g, max_len) fp32
        self.seen: dict[int, torch.Tensor] = {}               # layer -> (b, g, max_len): queries that saw each key

    def append_token(self) -> None:
        for plist in self.pos:
            plist.append(1 + max(plist))

    def kept_scores(self) -> list[list[list[dict[int, float]]]]:
        """[layer][b][g] -> {position: accumulated score} of every kept token."""
        return [[[{self.pos[b][i]: float(self.score[layer][b, g, i]) for i in kept} for g, kept in enumerate(per_b)]
                 for b, per_b in enumerate(self.keep[layer])] for layer in sorted(self.keep)]

    def snapshot(self) -> list[list[list[list[int]]]]:
        """[layer][b][g] -> sorted positions kept."""
        return [[[sorted(self.pos[b][i] for i in kept) for kept in per_b] for b, per_b in enumerate(self.keep[layer])]
                for layer in sorted(self.keep)]

    def pool(self, probs: torch.Tensor, b: int, g: int, r: int, query_rows: list[int]) -> torch.Tensor:
        """Attention mass per key for KV head g of sequence b: summed over its r query heads and the rows."""
        heads = list(range(g * r, (g + 1) * r))
        mass = probs[b][heads][:, query_rows].sum(dim=(0, 1))                       # (L,)
        return mass / r if self.score_reduce == "mean" else mass

    def ranking(self, layer: int, b: int, g: int, length: int) -> list[float]:
        """The scores the rule ranks by: the sums, or for "avg" the sums over the queries that saw each key."""
        if self.rule == "tova":                  # one ranking for the layer: the KV heads' summed mass
            return self.score[layer][b, :, :length].sum(dim=0).tolist()
        score = self.score[layer][b, g, :length]
        if self.rule == "avg":
            score = score / self.seen[layer][b, g, :length].clamp(min=1)
        if self.rule == "snapkv" and self.phase == "prefill":
            return ref_window_pooled(score.tolist(), self.pos[b][:length], self.score_window, self.pool_kernel)
        return score.tolist()

    def record_gap(self, b: int, ranking: list[float], chosen: set[int], others: list[int]) -> None:
        """The closest pair across one choice: a chosen index (kept, or the victim) against an unchosen candidate.
        Two exactly zero scores are no near tie: exp underflows to exactly 0 on every path and both resolve the tie
        by position (tests/test_h2o_decode's tie case)."""
        while len(self.gaps[b]) <= len(self.pos[b]) - self.prompt_width:
            self.gaps[b].append(float("inf"))
        step = len(self.pos[b]) - self.prompt_width
        for c in chosen:
            for o in others:
                a, z = ranking[c], ranking[o]
                if a + z > 0:
                    self.gaps[b][step] = min(self.gaps[b][step], abs(a - z) / (a + z))

    def budget_args(self, b: int) -> tuple[int, int, int]:
        """Sequence b's own (sink, heavy, recent); the window rule keeps no heavy hitters: their share is window."""
        sink, heavy, recent = self.budgets[b]
        if self.rule == "window":
            return sink, 0, heavy + recent
        return sink, heavy, recent


def masked_h2o_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """query (b, h, q, d); key, value (b, g, L, d), the full history. HF's mask is ignored: ours is built here."""
    # the state rides on the module rather than a global, so a second import of this file cannot split it
    st = getattr(module, STATE_ATTR, None)
    assert st is not None, "masked_h2o_attention runs only inside reference_generate"
    layer = module.layer_idx
    b, h, q, d = query.shape
    g, L = key.shape[1], key.shape[2]
    r = h // g
    scale = d ** -0.5 if scaling is None else scaling
    if st.phase == "prefill":
        allowed = prompt_allowed(st.pos, g, q, L)
    else:
        assert q == 1
        allowed = torch.zeros(b, g, q, L, dtype=torch.bool)
        new = L - 1
        for bi in range(b):
            for gi in range(g):
                st.keep[layer][bi][gi].add(new)          # the new token joins its column before attending
                st.score[layer][bi, gi, new] = 0.0
                allowed[bi, gi, 0, sorted(st.keep[layer][bi][gi])] = True
        if st.kv_bits is not None:
            raw_key, raw_value = key, value
            key, value = stored_history(st, key, value)
            if st.quant_log is not None:
                st.quant_log[layer] = (raw_key.clone(), raw_value.clone(), st.last_scale, st.last_key_input)
        if st.inv_freq is not None:
            query, key = roll_to_ranks(st, layer, query, key)
    # query head hi reads KV head hi // r (HF repeat_kv groups heads contiguously)
    out, probs, keys = grouped_masked_attention(query, key, value, allowed, scale)     # probs (b, h, q, L) fp32
    st.attn_mag = max(st.attn_mag, float((query.float().abs() @ keys.abs().transpose(-1, -2)).max()) * abs(scale))

    if st.phase == "prefill":
        st.keep[layer] = [[set() for _ in range(g)] for _ in range(b)]
        st.score[layer] = torch.zeros(b, g, st.max_len, dtype=torch.float32)
        st.seen[layer] = torch.zeros(b, g, st.max_len, dtype=torch.float32)
        for bi in range(b):
            sink, heavy, recent = st.budget_args(bi)
            real_rows = [j for j in range(q) if st.pos[bi][j] >= 0]
            score_rows = real_rows[-st.score_window:] if st.score_window else real_rows
            for gi in range(g):         # every head's scores first: tova ranks by their sum
                st.score[layer][bi, gi, :L] = st.pool(probs, bi, gi, r, score_rows)
                st.seen[layer][bi, gi, :L] = allowed[bi, gi, real_rows].sum(dim=0).float()
            rankings = [st.ranking(layer, bi, gi, L) for gi in range(g)]
            if st.head_floor is not None:          # head-adaptive: the layer's heads share their budget
                keeps = ref_adaptive_keep(rankings, st.pos[bi][:L], sink, heavy, recent, st.head_floor)
                st.head_heavy[(layer, bi)] = [len(k) - sink - recent if sum(p >= 0 for p in st.pos[bi]) >
                                              sink + heavy + recent else heavy for k in keeps]
            for gi in range(g):
                if st.rule == "full":            # no budget at all: every real prompt token stays
                    st.keep[layer][bi][gi] = {i for i in range(L) if st.pos[bi][i] >= 0}
                else:
                    ranking = rankings[gi]
                    st.keep[layer][bi][gi] = keeps[gi] if st.head_floor is not None else ref_keep_prefill(
                        ranking, st.pos[bi][:L], sink, heavy, recent, st.flip_ties)
                    if st.rule != "window":          # the window's choice is by position only
                        _, cand = prefill_candidates(st.pos[bi][:L], sink, recent)
                        kept_c = st.keep[layer][bi][gi] & set(cand)
                        st.record_gap(bi, ranking, kept_c, [i for i in cand if i not in kept_c])
                    if st.rule == "snapkv":          # decode adds to the pooled mass; the window keeps its own
                        raw = st.score[layer][bi, gi, :L].tolist()
                        st.score[layer][bi, gi, :L] = torch.tensor(
                            [r if rank == float("inf") else rank for r, rank in zip(raw, ranking)])
    else:
        for bi in range(b):
            sink, heavy, recent = st.budget_args(bi)
            for gi in range(g):         # every head's scores first: tova ranks by their sum
                col = st.pool(probs, bi, gi, r, [0])
                idx = torch.tensor(sorted(st.keep[layer][bi][gi]))
                if st.rule == "tova":
                    st.score[layer][bi, gi, idx] = col[idx]      # the last step's mass only
                elif st.decode_mass:
                    st.score[layer][bi, gi, idx] += col[idx]     # every kept key, the new one included
                st.seen[layer][bi, gi, idx] += 1
            for gi in range(g):
                kept = st.keep[layer][bi][gi]
                positions = [st.pos[bi][i] if i in kept else -1 for i in range(L)]
                ranking = st.ranking(layer, bi, gi, L)
                own = st.head_heavy[(layer, bi)][gi] if st.head_floor is not None else heavy    # this head's count
                victim = ref_victim(ranking, positions, sink, own, recent, st.rule, st.flip_ties)
                if victim is not None:
                    if st.rule not in ("window", "full"):      # the candidates ref_victim ranked
                        cand = victim_candidates(positions, sink, recent, st.rule)
                        st.record_gap(bi, ranking, {victim}, [i for i in cand if i != victim])
                    kept.discard(victim)
    return out.transpose(1, 2).contiguous(), probs


AttentionInterface.register(ATTN_NAME, masked_h2o_attention)


def _budget_triple(budget: Any) -> tuple[int, int, int]:
    if budget is None:
        return 0, 0, 0
    if isinstance(budget, (tuple, list)):
        sink, heavy, recent = budget
        return int(sink), int(heavy), int(recent)
    return int(budget.sink), int(budget.heavy), int(budget.recent)


@torch.no_grad()
def reference_generate(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       budget: Any, rule: str = "exact", max_new_tokens: int = 8, score_reduce: str = "sum",
                       trace: list | None = None, rolling: bool = False,
                       forced: torch.Tensor | None = None,
                       scores: list | None = None,
                       decode_mass: bool = True, flip_ties: bool = False,
                       kv_bits: tuple[int, int] | None = None,
                       near_ties: list | None = None,
                       quant_log: dict | None = None,
                       eviction: dict | None = None, score_window: int | None = None,
                       pool_kernel: int = 1, head_floor: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy generation with simulated eviction.

    input_ids (b, p), left-padded; attention_mask (b, p) 1 = real (None = all real); budget: (sink, heavy,
    recent) or any object with those attributes (ignored for rule "full"), or a list of them, one per sequence;
    rule: exact | port | window | avg | full | snapkv | tova; score_window, pool_kernel: EvictionConfig's;
    head_floor: head-adaptive budgets with that floor (h2o_rule.ref_adaptive_keep), None for uniform ones.
    Returns tokens (b, max_new_tokens) and the logits (b, V) fp32 that chose each of them. If `trace` is a
    list, it receives after the prefill and after every decode step the kept positions [layer][b][g].
    rolling: position rolling (RoPE models only). forced (b, max_new_tokens): feed these tokens instead of the
    argmax (teacher forcing, as the accuracy harness scores a continuation). scores: if a list, it receives at
    the end the accumulated score of every kept token, [layer][b][g] -> {position: score}. decode_mass=False:
    victims are chosen on the prefill scores alone; flip_ties=True: equal scores are resolved the wrong way round
    (tests use both to show that a run's victims depend on decode-time scores and on the tie order).
    kv_bits (bits, group size): the cache is compressed (see the module's docstring). near_ties: if a list, it
    receives per sequence the first decode step whose history held a rounding within NEAR_TIE of a boundary
    (None: none did); from that step on an engine may differ from this reference by a quantization step.
    quant_log: if a dict (kv_bits set), it receives {layer: (key, value, key scale, key input)} as the last decode
    step read them before rounding (key, value (b, g, L, d); scale (b, g, 1, d)); key input (b, g, L - 1, d): the
    older keys as the quantizer takes them (divided by the scale, turned back to position 0 when rolling), to
    compare an engine's quantizer inputs. eviction: if a dict, it receives "gaps" (per sequence, per forward: the
    least relative gap of its eviction choices), "attn_mag" (the largest sum |q k| scale) and "width" (the
    padded prompt's), for
    tolerances.eviction_tie_step."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if score_reduce not in ("sum", "mean"):
        raise ValueError(f"score_reduce must be 'sum' or 'mean', got {score_reduce!r}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = attention_mask.long()
    if not bool((mask[:, -1] == 1).all()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("reference_generate needs left padding (0...0 1...1 per row)")
    b, p = input_ids.shape
    per_row = isinstance(budget, list) and not all(isinstance(x, int) for x in budget)
    budgets = [_budget_triple(x) for x in budget] if per_row else [_budget_triple(budget)] * b
    if len(budgets) != b:
        raise ValueError(f"{len(budgets)} budgets for {b} sequences")
    inv_freq = None
    if rolling:
        rope = model.model.rotary_emb
        if float(getattr(rope, "attention_scaling", 1.0)) != 1.0:
            raise ValueError("rolling in the reference assumes RoPE without attention scaling")
        inv_freq = rope.inv_freq.float()
    state = _RefState(mask, budgets, rule, score_reduce, max_len=p + max_new_tokens, inv_freq=inv_freq)
    state.decode_mass, state.flip_ties, state.kv_bits = decode_mass, flip_ties, kv_bits
    state.score_window, state.pool_kernel, state.head_floor = score_window, pool_kernel, head_floor
    state.quant_log = quant_log
    old_impl, was_training = model.config._attn_implementation, model.training
    model.config._attn_implementation = ATTN_NAME
    model.eval()
    attn_modules = [m for m in model.modules() if hasattr(m, "layer_idx")]
    for m in attn_modules:
        setattr(m, STATE_ATTR, state)
    tokens, step_logits = [], []
    try:
        position_ids = torch.tensor(state.pos).clamp(min=0)                         # pads' positions are unused
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
        if trace is not None:
            trace.append(state.snapshot())
        state.phase = "decode"
        for step in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            step_logits.append(logits)
            nxt = logits.argmax(dim=-1) if forced is None else forced[:, step]
            tokens.append(nxt)
            if step == max_new_tokens - 1:
                break                            # the last token is never fed back
            state.append_token()
            mask = torch.cat([mask, mask.new_ones(b, 1)], dim=1)
            position_ids = torch.tensor([[plist[-1]] for plist in state.pos])
            out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=position_ids,
                        past_key_values=out.past_key_values, use_cache=True)
            if trace is not None:
                trace.append(state.snapshot())
        if scores is not None:
            scores.extend(state.kept_scores())
        if near_ties is not None:
            near_ties.extend(state.near_tie)
        if eviction is not None:
            eviction.update(gaps=state.gaps, attn_mag=state.attn_mag, width=state.prompt_width)
    finally:
        for m in attn_modules:
            delattr(m, STATE_ATTR)
        model.config._attn_implementation = old_impl
        model.train(was_training)
    return torch.stack(tokens, dim=1), step_logits
