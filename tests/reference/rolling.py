"""Position rolling in the masked reference (h2o_masked.py): kept keys turned to their rank among the kept
tokens, the query to the new token's, in float64 (HF's rotate-half RoPE pairing)."""
from __future__ import annotations

from typing import Any

import torch


def rotate(x: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Turn RoPE'd vectors x (..., d) further by `delta` (...) positions (HF's rotate-half pairing)."""
    angles = delta.double()[..., None] * inv_freq.double()                         # (..., d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = x.shape[-1] // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.double() * cos + rotated_half.double() * sin).to(x.dtype)


def roll_to_ranks(st: Any, layer: int, query: torch.Tensor, key: torch.Tensor):
    """Decode step with rolling: kept keys of each (b, g) turned to their ranks, queries to the new token's."""
    b, h, _, _ = query.shape
    g, L = key.shape[1], key.shape[2]
    key, query = key.clone(), query.clone()
    for bi in range(b):
        new_rank = None
        for gi in range(g):
            kept = sorted(st.keep[layer][bi][gi], key=lambda i: st.pos[bi][i])       # by true position
            for rank, i in enumerate(kept):
                key[bi, gi, i] = rotate(key[bi, gi, i], torch.tensor(rank - st.pos[bi][i]), st.inv_freq)
            new_rank = len(kept) - 1                                                  # the new token is last
        delta = torch.tensor(new_rank - st.pos[bi][L - 1])
        query[bi] = rotate(query[bi], delta, st.inv_freq)
    return query, key
