"""Inputs and torch references the compiled-kernel tests share: the AVX2 build's own tests (test_decode_kernel.py,
kv/test_compiled_commit.py, test_layer_math.py) and the portable build's check in a subprocess
(test_portable_kernels.py)."""
from __future__ import annotations

import torch

from flexgen_h2o.kv import Budget, get_policy
from flexgen_h2o.kv.cache import KVCache
from flexgen_h2o.models.layer import KVSpec, KVView, LayerOutput
from tests.tolerances import EPS32, gamma

# --- decode attention (csrc/decode_attention.cpp) ---


def decode_step(b, h, g, s, d, capacity, free=0.3, seed=0, q_scale=1.0):
    """One decode step's inputs as the engine hands them over: fp16 windows that are the first s of `capacity`
    slots (so not contiguous), a valid mask with the new token's slot set, its unrounded fp32 row."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, g, capacity, d, generator=gen).half()
    v = torch.randn(b, g, capacity, d, generator=gen).half()
    q = torch.randn(b, h, 1, d, generator=gen) * q_scale
    slot = torch.randint(0, s, (b, g), generator=gen)
    valid = torch.rand(b, g, s, generator=gen) > free
    valid.scatter_(2, slot.unsqueeze(-1), True)
    k_new, v_new = torch.randn(b, g, 1, d, generator=gen), torch.randn(b, g, 1, d, generator=gen)
    return q, k[:, :, :s], v[:, :, :s], valid, slot, k_new, v_new


DECODE_SHAPES = [
    (3, 9, 3, 409, 64, 410),     # SmolLM2's GQA at 20 % of 2k: 102 blocks of 4 keys and a tail of 1
    (2, 4, 4, 17, 64, 20),       # MHA (OPT), one head per group: two blocks of 8 keys and a tail of 1
    (2, 8, 2, 13, 80, 13),       # 4 heads per group (three at once, then one), 80 dims: 4 + 4 + 2 vectors
    (2, 12, 2, 37, 32, 40),      # 6 heads per group: two passes of three; 37 keys, blocks of 4 and a tail of 1
    (2, 4, 2, 30, 64, 30),       # 2 heads per group
    (1, 6, 3, 7, 12, 9),         # 12 dims, not a multiple of 8: the plain C++ loops; fewer keys than a block
    (4, 2, 1, 1, 64, 1),         # a window of one slot: the new token alone
]


# --- the commit of a decode step (csrc/commit_step.cpp): batch, KV heads, slots, head width ---

B, G, CAP, D = 7, 3, 24, 16


def column_state(seed: int, newest: int = 60) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (unique per column, -1 = free, one free slot at least) and scores with many exact ties."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.full((B, G, CAP), -1, dtype=torch.int32)
    for b in range(B):
        for g in range(G):
            n = int(torch.randint(CAP // 2, CAP, (1,), generator=gen))          # leaves >= 1 free slot
            if (b + g) % 3 == 0:   # consecutive newest positions, as a cache's recent window has them
                chosen = torch.cat([torch.randperm(newest - 12, generator=gen)[:n - 10], torch.arange(newest - 10,
                                                                                                   newest)])
            else:                  # scattered: the window's shortcut fails and the exact order decides
                chosen = torch.randperm(newest, generator=gen)[:n]
            slots = torch.randperm(CAP, generator=gen)[:n]
            pos[b, g, slots] = chosen.to(torch.int32)
    scores = torch.randint(0, 4, (B, G, CAP), generator=gen).float() / 4          # quarters: ties everywhere
    return pos, scores.masked_fill(pos < 0, 0.0)


def commit_cache(policy: str, budget: Budget, pos: torch.Tensor, scores: torch.Tensor, kv_dtype, kernels) -> KVCache:
    """kernels: a kernels.Kernels with the compiled build (the engine's), or ops.TORCH."""
    cache = KVCache(KVSpec(G, D), B, CAP, get_policy(policy), budget, dtype=kv_dtype, kernels=kernels)
    gen = torch.Generator().manual_seed(3)
    cache.k.copy_(torch.randn(B, G, CAP, D, generator=gen))
    cache.v.copy_(torch.randn(B, G, CAP, D, generator=gen))
    cache.pos.copy_(pos)
    cache.score.copy_(scores)
    cache.n_used = CAP
    return cache


def commit_step(cache: KVCache, seed: int, with_mass: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    slot = cache.free_slots()
    view = KVView(k=cache.k, v=cache.v, valid=cache.pos >= 0, write_slot=slot)
    # quarters, as the scores: sums keep tying, so the tie rule (the smaller position goes) decides victims
    mass = (torch.randint(0, 4, (B, G, CAP), generator=gen) / 4).masked_fill(cache.pos < 0, 0.0) if with_mass else None
    if mass is not None:
        mass.scatter_(2, slot.unsqueeze(-1), 0.25)                 # the new token attends to itself
    out = LayerOutput(hidden=None, k_new=torch.randn(B, G, 1, D, generator=gen),
                      v_new=torch.randn(B, G, 1, D, generator=gen), scores=mass)
    newest = int(cache.pos.max())
    cache.commit_decode(view, out, torch.arange(B) + newest + 1)


# --- layer math (csrc/layer_math.cpp) ---


def torch_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def rms_norm_bound(want: torch.Tensor, m: int) -> torch.Tensor:
    """Kernel against torch: per path the sum of m squares (positive terms: gamma(m) of the sum itself), / m and
    + eps (2 roundings) give the mean square to gamma(m + 2), its inverse square root halves that and adds
    one ulp (2 EPS32), x * r * w two more roundings: gamma(m + 2) / 2 + 4 EPS32 relative; two paths twice that,
    plus 2 EPS32 for second-order terms."""
    return (gamma(m + 2) + 10 * EPS32) * want.double().abs()


def silu_mul_bound(gate: torch.Tensor, up: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Kernel against torch: per path e^-|g| to 1 ulp (2 EPS32; sigmoid's relative error is at most e's), then
    1 + e, the division, g * s and * u (4 roundings): 6 EPS32 relative; two paths 12, 16 with second-order room.
    Below g = -87 e^g is subnormal (the AVX2 kernel gives 0 by design, the scalar one and torch's may flush or
    not): there the value's own size, |g e^g u| (exact, in double), either way."""
    g = gate.double()
    tiny = torch.where(g < -87, 2 * (g * g.exp() * up.double()).abs() + want.double().abs(), 0)
    return 16 * EPS32 * want.double().abs() + tiny


def torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
