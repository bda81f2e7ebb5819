"""Group-wise min-max quantization read back, written plainly for the references (nothing from flexgen_h2o)."""
from __future__ import annotations

import torch


def fake_quant(x: torch.Tensor, bits: int, group: int, margins: list | None = None) -> torch.Tensor:
    """x (..., d) quantized and read back: groups of `group` values along d (the last one padded with its last
    value), an fp16 minimum and step (max - min) / (2^bits - 1) per group, each value round((x - min) / step).
    margins: if a list, it receives per row of x (x.shape[:-1]) the least distance of an input from a rounding
    boundary (a value's level, the group minimum's or step's fp16 value), in the inputs' units: an input that
    another matmul order changes by that much can round the other way."""
    levels, d = 2 ** bits - 1, x.shape[-1]
    group = min(group, d + d % 2)
    pad = -d % group
    rows = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1) if pad else x
    groups = rows.float().reshape(*x.shape[:-1], -1, group)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step32 = (high - low) / levels
    step, low16 = step32.half().float(), low.half().float()
    level = torch.where(step > 0, (groups - low16) / step, torch.zeros_like(groups))
    if margins is not None:
        per_value = (0.5 - (level - level.round()).abs()) * step
        edges = [_half_margin(low), _half_margin(step32) * levels]
        margin = torch.minimum(per_value.amin(-1, keepdim=True), torch.minimum(*edges))
        margins.append(margin.amin(-2).squeeze(-1))
    q = level.round().clamp(0, levels)
    return (q * step + low16).reshape(*x.shape[:-1], -1)[..., :d].to(x.dtype)


def _half_margin(v: torch.Tensor) -> torch.Tensor:
    """How far each fp32 value is from a tie between its two nearest fp16 values."""
    h = v.half().float()
    spacing = torch.exp2(torch.floor(torch.log2(h.abs().clamp(min=2.0 ** -14))) - 10)
    return (spacing / 2 - (v - h).abs()).abs()
