"""ActivationHome: where one GPU batch's hidden state rests between schedule layers.

The policy's act percents split the block's sequences across tiers (any split works; FlexGen raised
NotImplementedError, FlexLLMGen #114). Hidden states keep the compute dtype on every tier, so a placement
never changes a result.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from flexgen_h2o.formats import format_of

Allocator = Callable[[str, tuple[int, ...], torch.dtype], Tensor]


class ActivationHome:
    def __init__(self, parts: list[tuple[int, int, str]], alloc: Allocator, device: torch.device):
        self.parts = parts                     # (first sequence, end sequence, tier kind)
        self.alloc, self.device = alloc, device
        self._buffers: dict[int, Tensor] = {}
        self._value: list[Tensor] | None = None
        self.bytes_moved = 0
        self._in_place = len(parts) == 1 and parts[0][2] == "compute"    # the hidden state stays where it is

    def store(self, x: Tensor) -> None:
        if self._value is not None:
            raise RuntimeError("schedule bug: hidden state stored twice without being loaded")
        if self._in_place:
            self._value = [x]
            return
        value = []
        for n, (lo, hi, kind) in enumerate(self.parts):
            part = x[lo:hi]
            if kind == "compute":
                value.append(part)
                continue
            buf = self._buffers.get(n)
            if buf is None or buf.shape != part.shape:
                buf = self._buffers[n] = self.alloc(kind, tuple(part.shape), part.dtype)
            format_of(part.dtype).stage(part, buf.device, part.dtype, into=buf)
            self.bytes_moved += part.numel() * part.element_size()
            value.append(buf)
        self._value = value

    def load(self) -> Tensor:
        if self._value is None:
            raise RuntimeError("schedule bug: hidden state loaded before it was stored")
        parts, self._value = self._value, None
        if self._in_place:
            return parts[0].to(self.device)
        moved = [p.to(self.device) if kind == "compute" else format_of(p.dtype).stage(p, self.device, p.dtype)
                 for p, (_, _, kind) in zip(parts, self.parts)]
        return moved[0] if len(moved) == 1 else torch.cat(moved)
