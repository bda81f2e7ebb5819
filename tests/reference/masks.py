"""What the masked references share (h2o_masked.py, pages_masked.py): token positions from a padding mask, the
prompt pass's causal mask with pads hidden, and grouped attention under a per-KV-head mask. Plain torch, nothing
from flexgen_h2o."""
from __future__ import annotations

import torch


def real_positions(attention_mask: torch.Tensor) -> list[list[int]]:
    """Per sequence, per cache index: the token's position among its sequence's real tokens, -1 for pads."""
    out = []
    for row in attention_mask.tolist():
        count, plist = 0, []
        for m in row:
            plist.append(count if m else -1)
            count += int(m)
        out.append(plist)
    return out


def prompt_allowed(pos: list[list[int]], g: int, q: int, L: int) -> torch.Tensor:
    """(b, g, q, L) the prompt pass's mask: causal, pads hidden; a pad query sees only itself (its output is
    unused)."""
    allowed = torch.zeros(len(pos), g, q, L, dtype=torch.bool)
    for bi, plist in enumerate(pos):
        for j in range(q):
            if plist[j] < 0:
                allowed[bi, :, j, j] = True
                continue
            allowed[bi, :, j, :j + 1] = torch.tensor([plist[i] >= 0 for i in range(j + 1)])
    return allowed


def grouped_masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query (b, h, q, d) over key, value (b, g, L, d), query head hi reading KV head hi // r (HF's repeat_kv), under
    allowed (b, g, q, L), in fp32. Returns out (b, h, q, d) in query's dtype, the probabilities (b, h, q, L) and the
    keys repeated per query head (b, h, L, d)."""
    h, g = query.shape[1], key.shape[1]
    r = h // g
    keys = torch.stack([key[:, hi // r] for hi in range(h)], dim=1).float()
    values = torch.stack([value[:, hi // r] for hi in range(h)], dim=1).float()
    mask = torch.stack([allowed[:, hi // r] for hi in range(h)], dim=1)
    logits = torch.matmul(query.float(), keys.transpose(-1, -2)) * scale
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, values).to(query.dtype), probs, keys
