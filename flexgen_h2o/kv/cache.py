"""KVCache: the fixed-capacity KV slots of one (attention layer, GPU batch), wherever they live.

Per sequence b and KV head g there are `capacity` slots. Each slot holds K, V, an fp32 accumulated score and
the token's original position (-1 = empty). Slots are unordered; the position travels with the token, so RoPE
and recency never depend on slot numbers.

    slot:   0   1   2   3   4   5   6   7        capacity = budget + 1
          [ s | h | r | h | r | · | r | h ]      s sink, h heavy hitter, r recent, · free (position -1)

A decode step writes the new token into a free slot (the attention layer does it in the staged view), adds
this step's attention to the scores, then asks the eviction policy for one victim per (b, g), whose slot is
marked free for the next step. Nothing is moved: the bytes written per step are one K/V row per (b, g) plus
the scores, whatever the tier. The cache owns bytes; the policy owns decisions (`docs/architecture.md`).
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Callable

import torch
from torch import Tensor

from flexgen_h2o.formats import StorageFormat, format_of
from flexgen_h2o.kv.budget import Budget, RowBudgets
from flexgen_h2o.kv.draws import KeyedDraws
from flexgen_h2o.kv.registry import trait
from flexgen_h2o.kv.select import pack_kept
from flexgen_h2o.kv.staging import StagingBuffers
from flexgen_h2o.models.layer import KVSpec, KVView, LayerOutput
from flexgen_h2o.models.ops import TORCH, TorchKernels, write_slot

Allocator = Callable[[tuple[int, ...], torch.dtype], Tensor]
BIG_POSITION = 1 << 40


def _plain_alloc(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype)


def gather_slots(x: Tensor, index: Tensor) -> Tensor:
    """x (b, g, p, ...) gathered along dim 2 by index (b, g, n)."""
    idx = index.view(*index.shape, *([1] * (x.dim() - 3))).expand(*index.shape, *x.shape[3:])
    return torch.gather(x, 2, idx)


class KVCache:
    reads_ahead = False     # page selection read a layer ahead (kv/pages.py): the executor chooses its pages early

    def __init__(self, spec: KVSpec, batch: int, capacity: int, policy, budget: Budget | RowBudgets, *,
                 dtype: torch.dtype = torch.float16, alloc: Allocator = _plain_alloc, tier_kind: str = "compute",
                 rolling: bool = False, generator: KeyedDraws | torch.Generator | None = None,
                 staging: StagingBuffers | None = None, read_in_place: bool = False, copy_stored: bool = False,
                 kernels: TorchKernels = TORCH, fmt: StorageFormat | None = None):
        """staging: reuse buffers for the compute-dtype windows staged on a CPU (None: a fresh copy each time).
        kernels: the engine's (flexgen_h2o.kernels.resolve); a compiled build commits a CPU-homed cache's steps.
        read_in_place: stage hands out the cache's own window (OffloadPolicy.kv_read_in_place decides).
        copy_stored: stage copies the window's stored rows as they are (fp16 or packed), for attention to read like
        an in-place window: batch-invariant kernels dequantize in one place, whichever tier the rows came from.
        budget: one Budget for every sequence, or RowBudgets with one per sequence (each evicts down to its own).
        fmt: the K/V rows' storage format (default: the plain one of `dtype`); a quantized one stores each slot's
        head_dim values as one byte row, packed when the row is committed (formats.QuantFormat)."""
        if isinstance(budget, RowBudgets) and len(budget) != batch:
            raise ValueError(f"{len(budget)} sequence budgets for a cache of {batch} sequences")
        rows = budget.rows if isinstance(budget, RowBudgets) else (budget,) * batch
        # the compiled commit's per-sequence counts, made once
        self._row_counts = tuple(torch.tensor([getattr(r, n) for r in rows], dtype=torch.long)
                                 for n in ("recent", "budget"))
        self.spec, self.batch, self.capacity = spec, batch, capacity
        self.staging, self.read_in_place, self.copy_stored = staging, read_in_place, copy_stored
        self.policy, self.budget, self.rolling, self.generator = policy, budget, rolling, generator
        self._step_scores = trait(policy.name, "step_scores")
        self.tier_kind, self.kernels = tier_kind, kernels
        g, d = spec.n_kv_heads, spec.head_dim
        self.fmt = format_of(dtype) if fmt is None else fmt
        self._allocate(alloc, self.fmt.row_width(d))                  # row width: d, or a quantized row's bytes
        self.pos.fill_(-1)
        self.score.zero_()
        # never-used slots are read (masked) by attention: garbage there would give 0 * NaN = NaN in p @ V
        # (an all-zero quantized row reads back as zeros: minimum 0, step 0)
        self.k.zero_()
        self.v.zero_()
        # a quantized cache stores keys divided by a per-channel scale taken from each sequence's prompt (the
        # largest |k| of the channel): outlier channels would otherwise set every token's group range. The
        # perplexity of per-token int4 groups with and without it, and of KIVI's per-channel keys:
        # `docs/compression.md` "Quality"
        self.k_scale = (torch.ones(batch, g, 1, d, dtype=torch.float32, device=self.k.device)
                        if self.fmt.quantized else None)                  # (b, g, 1, d)
        self.n_used = 0                    # high-water mark: slots [n_used, capacity) have never held a token
        self.bytes_read: Counter = Counter()
        self.bytes_written: Counter = Counter()

    def _allocate(self, alloc: Allocator, width: int) -> None:
        b, g, cap = self.batch, self.spec.n_kv_heads, self.capacity
        self.k = alloc((b, g, cap, width), self.fmt.dtype)    # (b, g, s, width)
        self.v = alloc((b, g, cap, width), self.fmt.dtype)    # (b, g, s, width)
        self.score = alloc((b, g, cap), torch.float32)        # (b, g, s) accumulated attention
        self.pos = alloc((b, g, cap), torch.int32)            # (b, g, s) original position, -1 = free

    # --- sizes ---

    @property
    def nbytes(self) -> int:
        scale = 0 if self.k_scale is None else self.k_scale.nbytes
        return scale + sum(t.numel() * t.element_size() for t in (self.k, self.v, self.score, self.pos))

    def _slot_bytes(self, n_slots: int, with_kv: bool = True, rows: int | None = None, per_head: bool = True) -> int:
        """Bytes of n_slots slots of every KV head of `rows` sequences (per_head=False: n_slots in all)."""
        kv = 2 * self.k.shape[-1] * self.k.element_size() if with_kv else 0
        heads = self.spec.n_kv_heads if per_head else 1
        return (self.batch if rows is None else rows) * heads * n_slots * (kv + 4 + 4)

    # --- batch maps (beam reorder, repeat, select: transformers' cache contract) ---

    def map_rows(self, fn) -> None:
        """Apply a batch-dimension map to every per-sequence part: K, V, the fp32 scores and positions (a beam's
        accumulated attention follows its keys), and each row's budget with its compiled-commit counts. `fn` maps
        a (b, ...) tensor; applied to arange(b) it names the source row of each new row."""
        for name in ("k", "v", "score", "pos") + (("k_scale",) if self.k_scale is not None else ()):
            old = getattr(self, name)
            new = fn(old)
            if new.shape == old.shape:
                old.copy_(new)       # same batch: stay in the allocated buffers
            else:
                setattr(self, name, new.contiguous())
        self.batch = self.k.shape[0]
        self._row_counts = tuple(fn(counts) for counts in self._row_counts)
        if isinstance(self.budget, RowBudgets):
            self.budget = RowBudgets(tuple(self.budget.rows[i] for i in fn(torch.arange(len(self.budget))).tolist()))

    # --- prefill ---

    def commit_prefill(self, k_new: Tensor, v_new: Tensor, scores: Tensor | None, token_pos: Tensor,
                       first_row: int = 0, unpadded: bool = False, key_scale: Tensor | None = None) -> None:
        """Keep the policy's choice of the prompt's rows for sequences [first_row, first_row + len(k_new)), so
        a prefill can commit chunk by chunk. k_new, v_new (b, g, p, d); scores (b, g, p) fp32 column sums
        (None when the policy needs none); token_pos (b, p) with -1 for pads. unpadded: the caller knows there
        are no pads (decided on the host), so a policy keeping every real row keeps all p of them in order.
        key_scale (b, g, 1, d): the per-channel key scale of rows already stored (a snapshot's, Engine.prefill)."""
        b, g, p, _ = k_new.shape
        rows = slice(first_row, first_row + b)
        self._set_key_scale(k_new, token_pos, rows, key_scale)
        positions = token_pos[:, None, :].expand(b, g, p).long()
        if unpadded and trait(self.policy.name, "keeps_every_row"):
            # every row, in order: slices, with no keep mask, packing, gather or host sync (the gathers show in
            # a GPU's full-cache prompt pass: `bash scripts/gpu_profile.sh DIR`)
            n_keep = self._room_for(p)
            k_rows, v_rows, pos_rows = k_new, v_new, positions
            score_rows = 0.0 if scores is None else scores
        else:
            budget, generator = self._row_rules(first_row, b)
            if self.policy.needs_scores:        # the rows and the scores decode starts from, in one pass
                keep, scores = self.policy.keep_and_scores(scores, positions, budget, generator)   # (b, g, p) each
            else:
                keep = self.policy.select_prefill(scores, positions, budget, generator)
            n_keep = self._room_for(int(keep.sum(-1).max().item()) if keep.numel() else 0)
            index, kept = pack_kept(keep, n_keep)           # kept rows first, in prompt order: (b, g, n) each
            k_rows, v_rows = gather_slots(k_new, index), gather_slots(v_new, index)
            sc = gather_slots(scores, index) if scores is not None else torch.zeros(b, g, n_keep, device=kept.device)
            score_rows = torch.where(kept, sc.float(), torch.zeros_like(sc, dtype=torch.float32))
            pos_rows = torch.where(kept, gather_slots(positions, index), -1)
        self.k[rows, :, :n_keep] = self._stored(k_rows, self.k_scale, rows)   # assignment casts to the cache's dtype
        self.v[rows, :, :n_keep] = self._stored(v_rows)
        self.score[rows, :, :n_keep] = score_rows
        self.pos[rows, :, :n_keep] = pos_rows
        self.n_used = max(self.n_used, n_keep)
        self.bytes_written[self.tier_kind] += self._slot_bytes(n_keep, rows=b)

    def _set_key_scale(self, k_new: Tensor, token_pos: Tensor, rows: slice, key_scale: Tensor | None) -> None:
        """A compressed cache's per-channel key scale for sequences `rows`: each channel's largest |k| over the
        sequence's real prompt tokens, or the given one (a snapshot's)."""
        if self.k_scale is None:
            return
        if key_scale is None:
            real = (token_pos >= 0)[:, None, :, None].to(k_new.device)
            key_scale = torch.where(real, k_new.abs(), 0).amax(dim=2, keepdim=True).float().clamp_(min=1e-30)
        self.k_scale[rows] = key_scale.to(self.k_scale.device)

    def _row_rules(self, first_row: int, b: int) -> tuple[Budget | RowBudgets, KeyedDraws | None]:
        """The budgets and random draws of sequences [first_row, first_row + b): a chunk of the prompt pass, or
        a row refilled alone, is selected against its own rows' budgets and keys, not the whole batch's."""
        if first_row == 0 and b == self.batch:
            return self.budget, self.generator
        budget = self.budget.part(first_row, first_row + b) if isinstance(self.budget, RowBudgets) else self.budget
        generator = self.generator.part(first_row, first_row + b) if isinstance(self.generator, KeyedDraws) \
            else self.generator
        return budget, generator

    def reset_row(self, row: int, budget: Budget, draw_key: int | None = None) -> None:
        """Free every slot of sequence `row` for a new prompt (continuous refill): positions -1, scores 0, the
        row's budget (and its compiled-commit counts) and random-rule key replaced. K/V bytes stay: a free slot
        is masked, and the new prompt's rows overwrite them. Nothing else moves, whatever the tier."""
        if budget.capacity > self.capacity:
            raise ValueError(f"a budget of {budget.budget} slots does not fit this cache's {self.capacity}")
        self.pos[row] = -1
        self.score[row] = 0.0
        if self.k_scale is not None:
            self.k_scale[row] = 1.0
        rows = list(self.budget.rows) if isinstance(self.budget, RowBudgets) else [self.budget] * self.batch
        rows[row] = budget
        self.budget = RowBudgets(tuple(rows))
        self._row_counts = tuple(torch.tensor([getattr(r, n) for r in rows], dtype=torch.long)
                                 for n in ("recent", "budget"))
        if isinstance(self.generator, KeyedDraws) and draw_key is not None:
            self.generator.keys[row] = KeyedDraws([draw_key]).keys[0]

    def _stored(self, rows: Tensor, key_scale: Tensor | None = None, batch_rows: slice = slice(None)) -> Tensor:
        """K or V rows in the cache's stored form (keys divided by their channel scale first: pass it). Rows
        already stored (a snapshot's, Engine.prefill) pass as they are, so re-committing never quantizes twice."""
        if self.fmt.quantized and rows.dtype == self.fmt.dtype:
            return rows
        if key_scale is not None:
            rows = rows / key_scale[batch_rows].to(rows.device)
        return self.fmt.pack(rows)

    def _room_for(self, n_keep: int) -> int:
        """n_keep, if that many prompt rows leave the current token its slot."""
        if n_keep > self.capacity - 1:
            raise RuntimeError(f"eviction policy kept {n_keep} prompt rows but the cache has "
                               f"{self.capacity - 1} before the current-token slot")
        return n_keep

    # --- decode ---

    def free_slots(self) -> Tensor:
        """(b, g) the lowest free slot of each (sequence, KV head); one always exists (capacity = budget + 1).
        A free slot holds position -1, below every kept one, and argmin returns the first of equal minima: one
        op where compare, cast and argmax were three (each a parallel region on a CPU, which wakes the sleeping
        OpenMP threads: `docs/architecture.md` "How a token flows")."""
        return self.pos_window(self.widest).argmin(dim=-1)

    @property
    def widest(self) -> int:
        """The most slots a column owns: every column's `capacity` here."""
        return self.capacity

    def place_token(self, slot: Tensor, k: Tensor | None, v: Tensor | None, position: Tensor) -> None:
        """Write a new token into each column's slot (b, g) before attention reads the cache's own rows (the HF
        cache's step): its K and V rows (b, g, 1, d), unless None, and its position (b,), which marks it valid."""
        if k is not None:
            write_slot(self.k, slot, k.to(self.k.dtype))
            write_slot(self.v, slot, v.to(self.v.dtype))
        self.pos.scatter_(2, slot.unsqueeze(-1), position.view(-1, 1, 1).expand(*slot.shape, 1).to(torch.int32))

    def stage(self, device: torch.device, dtype: torch.dtype, new_rank: Tensor | None = None) -> KVView:
        """Read the used window into compute dtype on `device` and pick each (b, g)'s write slot; a cache read in
        place hands out its own window instead (a narrow view: KVView.compute_dtype).
        new_rank (b,): with position rolling, the rank the new token will have among the kept tokens."""
        every_slot = self.pos_window(self.widest)             # one read of the positions serves both
        write_slot = every_slot.argmin(dim=-1)                  # free_slots()
        s = max(self.n_used, int(write_slot.max().item()) + 1)
        pos = every_slot[:, :, :s].to(device)
        self.bytes_read[self.tier_kind] += self._window_bytes(s)
        release = None
        if self.read_in_place or self.copy_stored:
            windows, col_start = self._own_windows(s)
            if not self.read_in_place:
                windows, release = self._copy_stored(windows, device)
            return KVView(k=windows[0], v=windows[1], valid=pos >= 0, write_slot=write_slot.to(device),
                          compute_dtype=dtype, format=self.fmt, release=release, col_start=col_start,
                          key_scale=None if self.k_scale is None else self.k_scale.to(device))
        into = (None, None)
        d = self.spec.head_dim
        windows = self.windows(s)
        # (a head-adaptive cache's window can be wider than capacity: it is staged into fresh tensors)
        if self.staging is not None and device.type == "cpu" and s <= self.capacity:
            # capacity-sized buffers: one pool key per cache, however wide the window
            flats = [self.staging.take(self.batch * self.spec.n_kv_heads * self.capacity * d, dtype)
                     for _ in windows]
            shape = (*windows[0].shape[:3], d)               # the window's values: (b, g, s, d)
            into = tuple(flat[:shape[0] * shape[1] * s * d].view(shape) for flat in flats)
            release = functools.partial(self.staging.give, *flats)
        k, v = self.values(s, device, dtype, into, windows)
        view = KVView(k=k, v=v, valid=pos >= 0, write_slot=write_slot.to(device), release=release)
        if self.rolling:
            view.key_positions = self._ranks(pos.long(), view.write_slot, new_rank.to(device))
        return view

    # --- the slot layout: (b, g, capacity) here; kv/ragged.py's pool of heads of different lengths overrides these

    def pos_window(self, s: int) -> Tensor:
        """(b, g, s) the positions of each column's slots [0, s)."""
        return self.pos[:, :, :s]

    def slot_scores(self, s: int) -> Tensor:
        """(b, g, s) the scores of each column's slots [0, s)."""
        return self.score[:, :, :s]

    def windows(self, s: int) -> tuple[Tensor, Tensor]:
        """K and V of each column's slots [0, s), stored form, (b, g, s, width): views of the cache's own rows."""
        return self.k[:, :, :s], self.v[:, :, :s]

    def _own_windows(self, s: int) -> tuple[tuple[Tensor, Tensor], Tensor | None]:
        """What a view of stored rows (read in place, or copied as they are) hands attention: the cache's own rows,
        and where each column starts in them (None: column (b, g) is row block [b, g])."""
        return self.windows(s), None

    def _window_bytes(self, s: int) -> int:
        return self._slot_bytes(s)

    def _copy_stored(self, windows: tuple[Tensor, Tensor], device: torch.device
                     ) -> tuple[tuple[Tensor, Tensor], Callable[[], None] | None]:
        """The stored rows of both windows copied to `device` as they are, into pooled buffers on a CPU."""
        if self.staging is None or device.type != "cpu":
            return tuple(w.to(device).clone(memory_format=torch.contiguous_format) for w in windows), None
        flats = [self.staging.take(self.k.numel(), self.fmt.dtype) for _ in windows]
        copies = tuple(flat[:w.numel()].view(w.shape).copy_(w) for flat, w in zip(flats, windows))
        return copies, functools.partial(self.staging.give, *flats)

    def values(self, s: int, device: torch.device, dtype: torch.dtype,
               into: tuple[Tensor | None, Tensor | None] = (None, None),
               windows: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """K and V of slots [0, s) as values on `device` in `dtype`, written into `into`'s buffers or fresh
        tensors: a compressed cache's rows dequantized there, keys multiplied back by their channel scale.
        windows: self.windows(s), when the caller has them."""
        d = self.spec.head_dim
        windows = self.windows(s) if windows is None else windows
        k, v = (self.fmt.stage(w, device, dtype, into=buf, n=d) for w, buf in zip(windows, into))
        if self.k_scale is not None:
            k.mul_(self.k_scale.to(device, dtype))
        return k, v

    @staticmethod
    def _ranks(pos: Tensor, write_slot: Tensor, new_rank: Tensor) -> Tensor:
        """Rank of every kept token by original position, per (b, g); the new token ranks last."""
        masked = torch.where(pos >= 0, pos, torch.full_like(pos, BIG_POSITION))
        ranks = masked.argsort(dim=-1).argsort(dim=-1)
        return ranks.scatter(2, write_slot.unsqueeze(-1), new_rank.view(-1, 1, 1).expand(*write_slot.shape, 1))

    def commit_decode(self, view: KVView, out: LayerOutput, new_pos: Tensor) -> None:
        """Write the new token's K/V row home, add this step's attention, evict one token per (b, g) if over
        budget. new_pos (b,) original positions of the new tokens."""
        slot = view.write_slot.to(self.k.device)                                        # (b, g)
        s = view.valid.shape[2]
        if self._compiled_commit():
            rule = self.policy.compiled_rule
            mass = out.scores.to(self.score.device) if out.scores is not None else torch.empty(0)
            recent, budget = self._row_counts
            k_new, v_new = (out.k_new.to(self.k.device), out.v_new.to(self.k.device))
            if self.fmt.quantized:           # the kernel copies packed rows; it does not quantize
                k_new, v_new = self._stored(k_new, self.k_scale), self._stored(v_new)
            self.kernels.commit_step(self.k, self.v, self.score, self.pos, slot, k_new, v_new,
                                     new_pos.to(self.k.device), mass, s, rule, self.budget.sink, recent, budget)
        else:
            self._commit_with_torch_ops(slot, s, out, new_pos)
        self.n_used = s
        # one K/V row per (b, g), plus the score and position columns
        self.bytes_written[self.tier_kind] += self._slot_bytes(1) + self._slot_bytes(s, with_kv=False)

    def _compiled_commit(self) -> bool:
        """The compiled commit (kernels/csrc/commit_step.cpp) takes a CPU-homed cache's step under the rules it
        implements (the policy names its rule; a quantized cache's rows are packed first); GPU caches and the
        random and window rules run kv/'s torch ops."""
        return self.policy.compiled_rule is not None and self.kernels.commit_usable(self.k)

    def _write_token(self, slot: Tensor, out: LayerOutput, new_pos: Tensor) -> None:
        """The new token's K and V rows (stored form) and position into each column's slot (b, g)."""
        write_slot(self.k, slot, self._stored(out.k_new.to(self.k.device), self.k_scale))
        write_slot(self.v, slot, self._stored(out.v_new.to(self.v.device)))
        write_slot(self.pos, slot, new_pos.to(self.pos.device).view(-1, 1, 1).expand(*slot.shape, 1))

    def _commit_with_torch_ops(self, slot: Tensor, s: int, out: LayerOutput, new_pos: Tensor) -> None:
        self._write_token(slot, out, new_pos)
        pos = self.pos[:, :, :s]
        score = self.score[:, :, :s]
        if out.scores is not None and self._step_scores:
            score.copy_(out.scores)                         # TOVA: the last step's attention only
        elif out.scores is not None:
            score += out.scores.to(self.score.device)       # free slots got 0 mass, the new slot starts at 0
        victim = self.policy.choose_victim(score, pos.long(), self.budget, generator=self.generator)
        # columns without a victim (-1) rewrite slot 0 with its own values: no host sync to find out
        has_victim = (victim >= 0).unsqueeze(-1)
        v_idx = victim.clamp(min=0).unsqueeze(-1)
        old_pos = pos.gather(2, v_idx)
        pos.scatter_(2, v_idx, torch.where(has_victim, torch.full_like(old_pos, -1), old_pos))
        old_score = score.gather(2, v_idx)
        score.scatter_(2, v_idx, torch.where(has_victim, torch.zeros_like(old_score), old_score))

    # --- inspection ---

    def kept_positions(self) -> list[list[list[int]]]:
        """Sorted original positions kept per (b, g): for tests and debugging."""
        out = []
        for b in range(self.pos.shape[0]):
            out.append([sorted(int(p) for p in self.pos[b, g] if p >= 0) for g in range(self.pos.shape[1])])
        return out
