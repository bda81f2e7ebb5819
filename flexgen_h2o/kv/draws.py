"""The random policy's draws, keyed by what a token is rather than by where it sits.

A torch.Generator hands out numbers in call order over a (batch, head, slot) tensor, so a sequence's draws would
depend on its batch-mates, its row, the window's width and the block cut. Here each draw is a hash of (seed, the
sequence's prompt tokens, layer, KV head, token position, step), so a prompt evicts the same tokens alone, in
any batch, in any block and after a resume (docs/cli.md, "What is guaranteed"). The hash is a 32-bit integer mix
in int64 tensor ops (every product stays below 2**63), cheap beside the attention it follows.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch
from torch import Tensor

_MASK = 0xFFFFFFFF
_MULT = 0x45D9F3B            # an odd 27-bit multiplier: a 32-bit value times it fits in int64


def _mix(x: Tensor) -> Tensor:
    """An avalanche of 32-bit values held in int64."""
    x = ((x ^ (x >> 16)) * _MULT) & _MASK
    x = ((x ^ (x >> 16)) * _MULT) & _MASK
    return x ^ (x >> 16)


def draws_for(generator: "KeyedDraws | torch.Generator | None", positions: Tensor, step: Tensor | int) -> Tensor:
    """(b, g, s) uniform draws: keyed ones where the cache has keys (the engine), else the generator's stream in
    call order (a cache built by hand, or the HF cache, which runs one batch as given)."""
    if isinstance(generator, KeyedDraws):
        return generator.uniform(positions, step)
    return torch.rand(positions.shape, generator=generator, device=positions.device)


def sequence_key(seed: int, layer: int, prompt: Sequence[int]) -> int:
    """One 32-bit key per (seed, layer, prompt): the prompt's tokens, not its index, so the same prompt draws the
    same numbers wherever it runs."""
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in prompt)
    return zlib.crc32(data, zlib.crc32(f"{seed}:{layer}".encode()))


class KeyedDraws:
    """Uniform numbers in [0, 1) per (sequence, KV head, token position, step) for one layer's cache rows."""

    def __init__(self, keys: Sequence[int] | Tensor):
        self.keys = torch.as_tensor(keys, dtype=torch.long) & _MASK          # (b,)

    @classmethod
    def for_prompts(cls, seed: int, layer: int, prompts: Sequence[Sequence[int]]) -> "KeyedDraws":
        return cls([sequence_key(seed, layer, p) for p in prompts])

    def part(self, lo: int, hi: int) -> "KeyedDraws":
        """The rows [lo, hi): one tier's share of a GPU batch."""
        return KeyedDraws(self.keys[lo:hi])

    def uniform(self, positions: Tensor, step: Tensor | int) -> Tensor:
        """positions (b, g, s) long; step: an int, or (b, g, 1) (a decode step's newest position) -> (b, g, s)
        float32 draws that depend on nothing else (not the slot, the row or the batch)."""
        b, g, _ = positions.shape
        if b != self.keys.shape[0]:
            raise ValueError(f"{self.keys.shape[0]} sequence keys for {b} rows")
        dev = positions.device
        h = _mix(self.keys.to(dev).view(b, 1, 1) ^ torch.arange(g, device=dev).view(1, g, 1))
        h = _mix(h ^ (torch.as_tensor(step, device=dev) & _MASK))
        h = _mix(h ^ (positions & _MASK))
        return (h >> 8).float() * (1.0 / 2 ** 24)          # 24 bits: exact in float32, never 1.0
