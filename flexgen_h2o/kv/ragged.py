"""RaggedKVCache: a head-adaptive cache (kv/adaptive.py), whose KV heads hold different numbers of slots.

A uniform cache gives every (sequence, KV head) column `capacity` slots: (b, g, capacity, width). Under head-adaptive
budgets one head of a layer may keep 3x its uniform share and another a fifth, so that shape would cost the largest
head's count for every head. Here each sequence has one pool of T = g * capacity slots, the layer's total, and each
column owns a run of it:

    sequence b:  [ head 0: 9 slots      | head 1: 3 | head 2: 12                ]     T = 3 * 8 = 24
                   col_start = 0          9           12
                   col_cap   = 9          3           12        (each: its kept rows + the free slot)

A sequence whose prompt fits its budget keeps the uniform layout (every column `capacity` slots, start h * capacity)
until its prompt is committed; the prefill then packs each head's kept rows at its start. The runs never move
during decode: a column writes its new token into a free slot of its own run and evicts one of its own tokens
against its own count (col_budget), exactly as a uniform column does against the row's. Attention reads a column's
own rows only: the compiled decode kernel walks each column from its start (KVView.col_start); elsewhere the
columns are gathered into a (b, g, s, width) window whose slots past a column's run are masked. Positions and
scores live in the same pool; policies see them as (b, g, s) windows.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexgen_h2o.kv.budget import Budget, RowBudgets
from flexgen_h2o.kv.cache import KVCache, gather_slots
from flexgen_h2o.kv.select import pack_kept
from flexgen_h2o.models.layer import KVView, LayerOutput
from flexgen_h2o.models.ops import column_rows


class ColumnBudgets:
    """A block's budgets, with each (sequence, KV head) column's own slot count (b, g) in place of the row's."""

    def __init__(self, rows: Budget | RowBudgets, per_column: Tensor):
        self.rows, self.per_column = rows, per_column

    def col(self, name: str, like: Tensor) -> int | Tensor:
        if name != "budget":
            return self.rows.col(name, like)
        counts = self.per_column.to(like.device)
        return counts.view(*counts.shape, *[1] * (like.dim() - 2))

    def __getattr__(self, name: str) -> Any:      # sink, policy, score_window, ...: the rows'
        return getattr(self.rows, name)


class RaggedKVCache(KVCache):
    def _allocate(self, alloc, width: int) -> None:
        b, g, cap = self.batch, self.spec.n_kv_heads, self.capacity
        self.k = alloc((b, g * cap, width), self.fmt.dtype)     # (b, T, width): the columns' runs, head by head
        self.v = alloc((b, g * cap, width), self.fmt.dtype)
        self.score = alloc((b, g * cap), torch.float32)
        self.pos = alloc((b, g * cap), torch.int32)
        device = self.k.device
        self.col_start = (torch.arange(g, device=device) * cap).repeat(b, 1)            # (b, g)
        self.col_cap = torch.full((b, g), cap, dtype=torch.long, device=device)          # (b, g)
        self.col_budget = self._row_counts[1].to(device)[:, None].repeat(1, g)                # (b, g): the rows'
        self._layout_changed()

    # --- the layout as (b, g, s) windows ---

    def _layout_changed(self) -> None:
        self._memo: dict = {}            # what the layout determines, made once per layout (every step reads it)

    def _columns(self, s: int) -> tuple[Tensor, Tensor]:
        """(rows, inside), both (b, g, s): the pool row of each column's slot i < s, and whether the slot is the
        column's own (slots past its run are masked and never written)."""
        if s not in self._memo:
            slots = torch.arange(s, device=self.k.device)
            inside = slots < self.col_cap[:, :, None]
            rows = (self.col_start[:, :, None] + slots).clamp_(max=self.pos.shape[1] - 1)
            self._memo[s] = rows, inside
        return self._memo[s]

    @property
    def widest(self) -> int:
        if "widest" not in self._memo:
            self._memo["widest"] = int(self.col_cap.max())
        return self._memo["widest"]

    def _gather(self, pool: Tensor, s: int, fill) -> Tensor:
        rows, inside = self._columns(s)
        b, g = rows.shape[:2]
        window = pool.gather(1, rows.view(b, g * s)).view(b, g, s)
        return torch.where(inside, window, torch.full((), fill, dtype=pool.dtype, device=pool.device))

    def pos_window(self, s: int) -> Tensor:
        return self._gather(self.pos, s, -1)

    def slot_scores(self, s: int) -> Tensor:
        return self._gather(self.score, s, 0.0)

    def windows(self, s: int) -> tuple[Tensor, Tensor]:
        return column_rows(self.k, self.col_start, s), column_rows(self.v, self.col_start, s)

    def _own_windows(self, s: int) -> tuple[tuple[Tensor, Tensor], Tensor | None]:
        return (self.k, self.v), self.col_start

    def _window_slots(self, s: int) -> int:
        """Slots a window of width s covers: each column's run, up to s."""
        if ("slots", s) not in self._memo:
            self._memo[("slots", s)] = int(self.col_cap.clamp(max=s).sum())
        return self._memo[("slots", s)]

    def _window_bytes(self, s: int) -> int:
        return self._slot_bytes(self._window_slots(s), per_head=False, rows=1)

    # --- prefill ---

    def commit_prefill(self, k_new: Tensor, v_new: Tensor, scores: Tensor | None, token_pos: Tensor,
                       first_row: int = 0, unpadded: bool = False, key_scale: Tensor | None = None) -> None:
        """KVCache.commit_prefill, with each head's kept rows packed into its own run: a sequence that evicts
        gives each head its kept count + 1 slots (the layer's total: adaptive_keep keeps g * budget rows), one
        that does not keeps the uniform layout."""
        b, g, p, _ = k_new.shape
        rows = slice(first_row, first_row + b)
        self._set_key_scale(k_new, token_pos, rows, key_scale)
        positions = token_pos[:, None, :].expand(b, g, p).long()
        budget, generator = self._row_rules(first_row, b)
        keep, scores = self.policy.keep_and_scores(scores, positions, budget, generator)      # (b, g, p) each
        device = self.k.device
        counts = keep.sum(-1).to(device)                                                       # (b, g)
        row_budget = self._row_counts[1][rows].to(device)                                     # (b,)
        evicts = ((positions[:, 0] >= 0).sum(-1).to(device) > row_budget)[:, None]            # (b, 1)
        caps = torch.where(evicts, counts + 1, self.capacity)
        self.col_cap[rows] = caps
        self.col_start[rows] = caps.cumsum(dim=1) - caps
        self.col_budget[rows] = torch.where(evicts, counts, row_budget[:, None])
        self._layout_changed()
        n_keep = int(counts.max()) if counts.numel() else 0
        index, kept = pack_kept(keep, n_keep)                  # kept rows first, in prompt order: (b, g, n) each
        kept = kept.to(device)
        dest = (self.col_start[rows][:, :, None] + torch.arange(n_keep, device=device))[kept]
        seq = torch.arange(b, device=device)[:, None, None].expand(b, g, n_keep)[kept]
        k_rows = self._stored(gather_slots(k_new, index), self.k_scale, rows).to(device)
        v_rows = self._stored(gather_slots(v_new, index)).to(device)
        self.pos[rows] = -1
        self.score[rows] = 0.0
        self.k[rows][seq, dest] = k_rows[kept].to(self.k.dtype)
        self.v[rows][seq, dest] = v_rows[kept].to(self.v.dtype)
        self.score[rows][seq, dest] = gather_slots(scores, index).float().to(device)[kept]
        self.pos[rows][seq, dest] = gather_slots(positions, index).to(device)[kept].int()
        self.n_used = max(self.n_used, n_keep)
        self.bytes_written[self.tier_kind] += self._slot_bytes(int(counts.sum()), per_head=False, rows=1)

    def reset_row(self, row: int, budget: Budget, draw_key: int | None = None) -> None:
        """KVCache.reset_row, and the row's runs back to the uniform layout until its new prompt is committed."""
        super().reset_row(row, budget, draw_key)
        g = self.spec.n_kv_heads
        self.col_start[row] = torch.arange(g, device=self.k.device) * self.capacity
        self.col_cap[row] = self.capacity
        self.col_budget[row] = budget.budget
        self._layout_changed()

    def map_rows(self, fn) -> None:
        super().map_rows(fn)
        for name in ("col_start", "col_cap", "col_budget"):
            setattr(self, name, fn(getattr(self, name)).contiguous())
        self._layout_changed()

    # --- decode ---

    def commit_decode(self, view: KVView, out: LayerOutput, new_pos: Tensor) -> None:
        """KVCache.commit_decode in each column's own run, each against its own count."""
        slot = view.write_slot.to(self.k.device)                                        # (b, g)
        s = view.valid.shape[2]
        k_new, v_new = out.k_new.to(self.k.device), out.v_new.to(self.k.device)
        if self._compiled_commit() and getattr(self.kernels.ext, "takes_column_starts", False):
            mass = out.scores.to(self.score.device) if out.scores is not None else torch.empty(0)
            if self.fmt.quantized:           # the kernel copies packed rows; it does not quantize
                k_new, v_new = self._stored(k_new, self.k_scale), self._stored(v_new)
            self.kernels.commit_step(self.k, self.v, self.score, self.pos, slot, k_new, v_new,
                                     new_pos.to(self.k.device), mass, s, self.policy.compiled_rule,
                                     self.budget.sink, self._row_counts[0], self.col_budget, self.col_start,
                                     self.col_cap)
        else:
            self._commit_with_torch_ops(slot, s, out, new_pos)
        self.n_used = s
        # one K/V row per column, plus the score and position columns of each column's window
        self.bytes_written[self.tier_kind] += self._slot_bytes(1) + self._slot_bytes(
            self._window_slots(s), with_kv=False, per_head=False, rows=1)

    def place_token(self, slot: Tensor, k: Tensor | None, v: Tensor | None, position: Tensor) -> None:
        b, g = slot.shape
        row = self.col_start + slot.to(self.col_start.device)                           # (b, g) pool rows
        width = self.k.shape[-1]
        if k is not None:
            for pool, new in ((self.k, k), (self.v, v)):
                pool.scatter_(1, row[:, :, None].expand(b, g, width), new.reshape(b, g, width).to(pool.dtype))
        self.pos.scatter_(1, row, position.to(self.pos.device).view(-1, 1).expand(b, g).to(torch.int32))

    def _commit_with_torch_ops(self, slot: Tensor, s: int, out: LayerOutput, new_pos: Tensor) -> None:
        b, g = slot.shape
        self.place_token(slot, self._stored(out.k_new.to(self.k.device), self.k_scale),
                         self._stored(out.v_new.to(self.v.device)), new_pos)
        rows, inside = self._columns(s)
        if out.scores is not None:            # free slots got 0 mass, the new slot starts at 0; none past a run
            mass = torch.where(inside, out.scores.to(self.score.device), 0.0)
            self.score.scatter_add_(1, rows.view(b, g * s), mass.view(b, g * s))
        victim = self.policy.choose_victim(self.slot_scores(s), self.pos_window(s).long(),
                                           ColumnBudgets(self.budget, self.col_budget), generator=self.generator)
        has_victim = victim >= 0
        at = self.col_start + victim.clamp(min=0)
        self.pos.scatter_(1, at, torch.where(has_victim, -1, self.pos.gather(1, at)))
        self.score.scatter_(1, at, torch.where(has_victim, 0.0, self.score.gather(1, at)))

    # --- inspection ---

    def kept_positions(self) -> list[list[list[int]]]:
        out = []
        for b in range(self.batch):
            runs = zip(self.col_start[b].tolist(), self.col_cap[b].tolist())
            out.append([sorted(int(p) for p in self.pos[b, lo:lo + n] if p >= 0) for lo, n in runs])
        return out

    def head_counts(self) -> list[list[int]]:
        """[b][g] the slots each column keeps after eviction (its budget): for tests and the startup report."""
        return self.col_budget.tolist()
