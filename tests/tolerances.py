"""Tolerances between two computations that round differently, each derived from the arithmetic's error bound
rather than tuned on one CPU (AVX2, AVX-512, MKL, oneDNN and this project's kernels sum in other orders).

Standard bounds (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1 and 3.5): a sum or dot product of
n terms computed in any order in a format of unit roundoff u is within gamma(n) * sum |x_i * w_i| of the exact
value, gamma(n) = n u / (1 - n u). Two implementations are each that close to the exact value, so they are
within twice that of each other.
"""
from __future__ import annotations

import math

import torch

EPS32 = 2.0 ** -24          # fp32 unit roundoff: one rounding moves a value by at most EPS32 * |value|
EPS16 = 2.0 ** -11          # fp16 unit roundoff (an fp16-stored value's relative error)


def gamma(n: int, u: float = EPS32) -> float:
    """gamma(n): the relative bound of n accumulated roundings (n u < 1)."""
    return n * u / (1 - n * u)


def dot_bound(x: torch.Tensor, w: torch.Tensor, u: float = EPS32, extra: int = 0) -> torch.Tensor:
    """Elementwise bound on |x @ w.T computed in two orders - each other|: 2 gamma(k + extra) |x| @ |w|.T, k the
    reduction length; `extra` roundings per term on top (a bias added, a scale multiplied, an fp16 product)."""
    k = x.shape[-1]
    return 2 * gamma(k + extra, u) * (x.double().abs() @ w.double().abs().transpose(-1, -2))


def linear_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, u: float = EPS32,
                 extra: int = 0) -> torch.Tensor:
    """dot_bound for x @ w.T + bias (w (n, k) as F.linear takes it): the bias is one more term of the sum, so
    gamma(k + 1 + extra) covers it, counted at its own magnitude."""
    if bias is None:
        return dot_bound(x, w.float(), u, extra)
    return dot_bound(x, w.float(), u, extra + 1) + 2 * gamma(x.shape[-1] + 1 + extra, u) * bias.double().abs()


def attention_bounds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     query_valid: torch.Tensor | None = None, extra: int = 0, k_mag: torch.Tensor | None = None,
                     v_mag: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds on |output difference| (b, h, t, d) and |score difference| (b, g, s) between two fp32 computations
    of masked softmax attention (h query heads read KV head h // (h / g); scores: each key's probability summed
    over the valid queries and the group's heads) that round in other orders. q (b, h, t, d), k, v (b, g, s, d),
    mask (b, h or 1, t, s) True = attend. Derived per query row, in double from the exact probabilities p:
    - the exponent x_i = s_i - max: each path's logit within gamma(d + 1) sum |q k| scale (the scale one more
      rounding) and the subtraction within EPS32 |x_i|: e_i = 2 (both) of that;
    - softmax: exponents moved by e_i move p_i by a factor within e^{+-(e_i + max e)}, and each path's exp (1 ulp,
      2 EPS32), sum of s terms and division add gamma(s + 3) relative: |dp_i| <= p_i (expm1(2 max e) + 2 gamma(s + 3));
    - output sum_i p_i v_i: sum |dp_i| |v_i| + 2 gamma(s) sum p_i |v_i|;
    - a score, n probabilities added: sum |dp| + 2 gamma(n) sum p.
    extra: roundings each K and V value takes on its way in (a dequantization: q * step + min, 2), counted on
    k_mag, v_mag (default |k|, |v|): the magnitudes those roundings are relative to (|q step| + |min|)."""
    r = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(r, 1), v.double().repeat_interleave(r, 1)
    km = kd.abs() if k_mag is None else k_mag.double().repeat_interleave(r, 1)
    vm = vd.abs() if v_mag is None else v_mag.double().repeat_interleave(r, 1)
    s_len = k.shape[2]
    allowed = torch.ones(qd.shape[:3] + (s_len,), dtype=torch.bool) if mask is None else mask.expand(
        qd.shape[:3] + (s_len,))
    logits = (qd @ kd.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    x = (logits - logits.amax(-1, keepdim=True)).masked_fill(~allowed, 0).abs()
    e = 2 * (gamma(q.shape[-1] + 1 + extra) * (qd.abs() @ km.transpose(-1, -2)) * abs(scale) + EPS32 * x)
    e = e.masked_fill(~allowed, 0)
    dp = p * (torch.expm1(2 * e.amax(-1, keepdim=True)) + 2 * gamma(s_len + 3))
    out = dp @ vm + 2 * gamma(s_len + extra) * (p @ vm)
    valid = torch.ones(qd.shape[:3], dtype=torch.bool) if query_valid is None else query_valid[:, None, :].expand(
        qd.shape[:3])
    n = int(valid[0].sum(-1).max()) if valid.numel() else 0
    dp_sum = (dp * valid[..., None]).sum(2)                                   # (b, h, s)
    p_sum = (p * valid[..., None]).sum(2)
    score = dp_sum.view(k.shape[0], k.shape[1], r, s_len).sum(2) + 2 * gamma(n * r + 1) * p_sum.view(
        k.shape[0], k.shape[1], r, s_len).sum(2)
    return out, score


def decode_attention_bounds(q, k, v, valid, slot, k_new, v_new, scale: float, reduce: str = "sum", extra: int = 0,
                            group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_bounds for one decode step as ops.narrow_decode_attention takes it: q (b, h, 1, d), windows
    k, v (b, g, s, d) (values: fp16 rows, or a quantized window dequantized), valid (b, g, s), the new token's
    unrounded rows k_new, v_new (b, g, 1, d) at `slot` (b, g). Returns the output's bound (b, h, 1, d) and the
    key mass's (b, g, s) (reduce "mean": divided by the group's r heads, one rounding more). group: the window
    is group-wise quantized in groups of `group` values: each value's dequantization (extra roundings) is
    relative to |q step| + |min| <= 3 max |value| of its group, not to the value."""
    b, g, s_len, d = k.shape
    r = q.shape[1] // g
    idx = slot[:, :, None, None].expand(b, g, 1, d)
    kf, vf = k.float().scatter(2, idx, k_new.float()), v.float().scatter(2, idx, v_new.float())
    mags = [None, None]
    if group is not None:
        for i, x in enumerate((kf, vf)):
            pad = -d % group
            rows = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1) if pad else x
            top = rows.abs().reshape(*x.shape[:-1], -1, group).amax(-1, keepdim=True)
            mags[i] = (x.abs() + 3 * top.expand(*top.shape[:-1], group).reshape(rows.shape)[..., :d])
    mask = valid.repeat_interleave(r, 1)[:, :, None, :]
    out, mass = attention_bounds(q, kf, vf, mask, scale, torch.ones(b, 1, dtype=torch.bool), extra, *mags)
    if reduce == "mean":
        mass = mass / r * (1 + 2 * EPS32)
    return out, mass


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float, what: str = "") -> None:
    """|got - want| <= bound elementwise (bound broadcast), with the worst ratio in the message."""
    diff = (got.double() - want.double()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64)
    over = diff > bound
    assert not bool(over.any()), (f"{what}: {int(over.sum())} of {diff.numel()} over their bound, worst "
                                  f"|diff| / bound = {float((diff / bound.clamp(min=1e-300)).max()):.3g}")


def greedy_agreement(tokens: list[int], want: list[int], want_logits: list[torch.Tensor],
                     bound: torch.Tensor | float, what: str = "") -> int:
    """Greedy tokens of two paths that round differently, step by step, against the second path's logits
    (each (V,)) and a bound on the two paths' logit difference: a token may differ only where the second path's
    best two logits are within 2 * bound (each may move by `bound`, so either path may pick either). Returns
    the number of steps whose inputs were the same (through the first different token: after it the two runs
    read other tokens and nothing more is comparable)."""
    for t, (a, b) in enumerate(zip(tokens, want)):
        if a != b:
            top2 = want_logits[t].double().topk(2).values
            margin = float(top2[0] - top2[1])
            limit = 2 * float(torch.as_tensor(bound).max())
            assert margin <= limit, f"{what}: step {t} picked {a} not {b}, a margin of {margin:.3g} > {limit:.3g}"
            return t + 1
    return min(len(tokens), len(want))


def logit_bound(model, logits: torch.Tensor) -> float:
    """A documented bound on |logit difference| between two fp32 runs of a whole model that order their sums
    differently (a rigorous one through norms, softmax and residuals is impractical): each of the 6 L + 1
    chained products (q, k, v, o and two MLP products per layer, the head) adds 2 gamma(k) relative error, k the
    widest reduction (the MLP's), counted at the logits' own scale (max |logit|), i.e. assuming a layer does not
    amplify a relative error (residual stream plus norm: near-isometric). For the tests' 2-layer width-64/128
    models at |logit| <= 3 that is ~6e-4, over x100 what any CPU has shown (~1e-6), and under a quantization
    level's effect on them (1e-3 to 1e-2)."""
    cfg = model.config
    k = max(cfg.hidden_size, getattr(cfg, "intermediate_size", 0) or getattr(cfg, "ffn_dim", 0))
    n = 6 * cfg.num_hidden_layers + 1
    return 2 * gamma(k) * n * float(logits.abs().max())


def score_rel_bound(model, attn_mag: float, n_keys: int, n_terms: int) -> float:
    """A documented relative bound on |H2O score difference| between two fp32 runs of a whole model (logit_bound's
    assumption: each of the 6 L + 1 chained products adds 2 gamma(k) relative error and no layer amplifies it),
    taken at the attention's own scale attn_mag (the largest sum |q k| scale, what an attention logit's rounding
    is relative to): logits move by e = 2 gamma(k) (6 L + 1) attn_mag, so (attention_bounds) each probability by
    p (expm1(2 e) + 2 gamma(n_keys + 3)), and a score of n_terms probabilities (queries x heads) by that plus
    2 gamma(n_terms) of itself."""
    cfg = model.config
    k = max(cfg.hidden_size, getattr(cfg, "intermediate_size", 0) or getattr(cfg, "ffn_dim", 0))
    e = 2 * gamma(k) * (6 * cfg.num_hidden_layers + 1) * attn_mag
    return math.expm1(2 * e) + 2 * gamma(n_keys + 3) + 2 * gamma(n_terms)


def eviction_tie_step(gaps: list[list[float]], rel: float, n_steps: int, what: str = "") -> list[int]:
    """Per sequence, how many greedy steps two differently rounding runs of the same eviction rule read the same
    kept keys: gaps[b][t] the reference's least |a - b| / (a + b) across forward t's eviction choices (its
    eviction dict, tests/reference/h2o_masked); a choice with gap <= rel (each score may move by rel of itself)
    is a near tie that either run may resolve either way, so logits from t + 1 on may differ. n_steps where
    none is; each near tie is reported (printed, seen with pytest -s or on failure)."""
    out = []
    for b, per_step in enumerate(gaps):
        tie = next((t for t, g in enumerate(per_step) if g <= rel), None)
        if tie is not None:
            print(f"{what}: sequence {b} evicts at a near tie at step {tie} (gap {per_step[tie]:.3g} <= {rel:.3g})")
        out.append(n_steps if tie is None else min(n_steps, tie + 1))
    return out
