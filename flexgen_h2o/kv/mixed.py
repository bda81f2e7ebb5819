"""SplitKVCache: one GPU batch's cache split by whole sequences across tiers (FlexGen's mixed device for KV).

Sequences are independent under every eviction policy, so a split cache is just one KVCache per contiguous
range of sequences; staging concatenates their windows and committing slices the step's outputs back.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from flexgen_h2o.kv.cache import KVCache, gather_slots
from flexgen_h2o.models.layer import KVView, LayerOutput
from flexgen_h2o.models.ops import column_rows


def _pad_slots(x: Tensor, s: int, fill) -> Tensor:
    if x.shape[2] == s:
        return x
    pad_shape = list(x.shape)
    pad_shape[2] = s - x.shape[2]
    return torch.cat([x, torch.full(pad_shape, fill, dtype=x.dtype, device=x.device)], dim=2)


def _as_window(view: KVView) -> KVView:
    """A view read in place from a head-adaptive cache's row pool (KVView.col_start) as a (b, g, s, width) window
    of its columns, which joins the other parts' windows."""
    if view.col_start is None:
        return view
    s = view.valid.shape[2]
    return dataclasses.replace(view, k=column_rows(view.k, view.col_start, s), v=column_rows(view.v, view.col_start, s),
                               col_start=None)


def _join(views: list[KVView]) -> KVView:
    """The parts' views as one window of the whole batch (the widest part's slots; the others' padded, masked)."""
    views = [_as_window(v) for v in views]
    s = max(v.valid.shape[2] for v in views)
    cat = lambda name, fill: torch.cat([_pad_slots(getattr(v, name), s, fill) for v in views])  # noqa: E731
    first = views[0]      # stored rows copied as they are (KVCache.copy_stored) stay in their format
    view = KVView(k=cat("k", 0), v=cat("v", 0), valid=cat("valid", False),
                  write_slot=torch.cat([v.write_slot for v in views]), compute_dtype=first.compute_dtype,
                  format=first.format,
                  key_scale=None if first.key_scale is None else torch.cat([v.key_scale for v in views]))
    if views[0].key_positions is not None:
        view.key_positions = cat("key_positions", 0)
    for part in views:                     # the parts were copied into the joint window
        if part.release is not None:
            part.release()
    return view


class SplitKVCache:
    def __init__(self, parts: list[tuple[int, int, KVCache]], attention_device: torch.device | None = None):
        self.parts = parts                     # (first sequence, end sequence, cache over that range)
        # cpu_cache_compute: the window is staged (fp32) where the KV lives and attention runs there, so only
        # the query and the output cross the link (FlexGen's CPU attention)
        self.attention_device = attention_device

    @property
    def caches(self) -> list[KVCache]:
        return [c for _, _, c in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def reads_ahead(self) -> bool:
        return self.caches[0].reads_ahead

    def commit_prefill(self, k_new: Tensor, v_new: Tensor, scores: Tensor | None, token_pos: Tensor,
                       first_row: int = 0, unpadded: bool = False, key_scale: Tensor | None = None) -> None:
        """The prompt rows of sequences [first_row, first_row + len(k_new)), which may span several parts."""
        end = first_row + k_new.shape[0]
        for lo, hi, cache in self.parts:
            a, z = max(lo, first_row), min(hi, end)
            if a >= z:
                continue
            src = slice(a - first_row, z - first_row)
            cache.commit_prefill(k_new[src], v_new[src], None if scores is None else scores[src],
                                 token_pos[src], first_row=a - lo, unpadded=unpadded,
                                 key_scale=None if key_scale is None else key_scale[src])

    def reset_row(self, row: int, budget, draw_key: int | None = None) -> None:
        """Free sequence `row`'s slots for a new prompt (KVCache.reset_row), in whichever part holds it."""
        for lo, hi, cache in self.parts:
            if lo <= row < hi:
                cache.reset_row(row - lo, budget, draw_key)
                return
        raise IndexError(f"row {row} is not in this cache")

    def snapshot(self) -> tuple[Tensor, ...]:
        """Every slot of every part as host tensors (k, v, score, pos), pos -1 for an empty slot, and a compressed
        cache's per-channel key scale (b, g, 1, d) after them: what commit_prefill needs to rebuild this prompt's
        cache under another eviction rule."""
        s = min(c.capacity for c in self.caches)
        out = tuple(torch.cat([getattr(c, name)[:, :, :s].to("cpu", copy=True) for c in self.caches])
                    for name in ("k", "v", "score", "pos"))
        if self.caches[0].k_scale is not None:
            out += (torch.cat([c.k_scale.to("cpu", copy=True) for c in self.caches]),)
        return out

    def stage(self, device: torch.device, dtype: torch.dtype, new_rank: Tensor | None = None) -> KVView:
        if self.attention_device is not None:
            device, dtype = self.attention_device, torch.float32
        views = [c.stage(device, dtype, None if new_rank is None else new_rank[lo:hi]) for lo, hi, c in self.parts]
        self._widths = [v.valid.shape[2] for v in views]
        if len(views) == 1:
            return views[0]
        if views[0].select is not None:        # each part reads the pages its rows' queries need, then they join
            return dataclasses.replace(_join(views), select=functools.partial(self.select, device, dtype))
        return _join(views)

    def select(self, device: torch.device, dtype: torch.dtype, q: Tensor) -> KVView:
        """The pages query q (b, h, 1, d) needs, from every part (kv/pages.py PagedKVCache.select), joined."""
        return self.read(self.choose(q), device, dtype)

    def choose(self, q: Tensor) -> list:
        """Each part's choice of pages for its rows of query q (PagedKVCache.choose)."""
        return [c.choose(q[lo:hi]) for lo, hi, c in self.parts]

    def read(self, choices: list, device: torch.device, dtype: torch.dtype) -> KVView:
        """The pages `choose` picked, read from every part's tier and joined."""
        if self.attention_device is not None:
            device, dtype = self.attention_device, torch.float32
        views = [c.read(choice, device, dtype) for choice, (_, _, c) in zip(choices, self.parts)]
        return views[0] if len(views) == 1 else _join(views)

    def commit_decode(self, view: KVView, out: LayerOutput, new_pos: Tensor) -> None:
        if len(self.parts) == 1:              # one tier: its own view, as staged
            self.parts[0][2].commit_decode(view, out, new_pos)
            return
        for (lo, hi, cache), width in zip(self.parts, self._widths):
            part_view = KVView(k=view.k[lo:hi, :, :width], v=view.v[lo:hi, :, :width],
                               valid=view.valid[lo:hi, :, :width], write_slot=view.write_slot[lo:hi])
            part_out = LayerOutput(hidden=out.hidden, k_new=out.k_new[lo:hi], v_new=out.v_new[lo:hi],
                                   scores=None if out.scores is None else out.scores[lo:hi, :, :width])
            cache.commit_decode(part_view, part_out, new_pos[lo:hi])


def prompt_layout(snapshot: tuple[Tensor, ...], lengths: Tensor, width: int) -> tuple[Tensor, ...]:
    """A keep-everything cache's slots (real tokens packed first, in order) back in the left-padded prompt layout
    a prompt pass hands to commit_prefill: (k, v, score) (b, g, width, ...) and token positions (b, width), -1
    for pads. Same shapes and order as a normal run's, so even the random rule draws the same numbers. A
    compressed cache's per-channel key scale (a fifth tensor) passes through."""
    k, v, score, pos = snapshot[:4]
    shift = (width - lengths).view(-1, 1)                                          # pads before each sequence
    src = torch.arange(width).view(1, -1) - shift                                  # (b, width) source slot
    real = src >= 0
    index = src.clamp(min=0)
    take = lambda x: gather_slots(x, index[:, None, :].expand(x.shape[0], x.shape[1], width))  # noqa: E731
    k, v, score = (torch.where(real.view(*real.shape[:1], 1, width, *([1] * (x.dim() - 3))), take(x),
                               torch.zeros((), dtype=x.dtype)) for x in (k, v, score))
    return (k, v, score, torch.where(real, pos[:, 0].long().gather(1, index), -1), *snapshot[4:])
