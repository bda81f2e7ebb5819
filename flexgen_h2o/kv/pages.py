"""PagedKVCache: a cache that keeps every token and lets each decode step read only the pages its query needs.

Eviction decides at the prompt what a sequence may ever attend to. Here nothing is dropped: the K/V rows stay
whole on their tier (compute, host or disk, fp16 or compressed), in the full cache's layout, where slot i of a
sequence holds its i-th token. A page is `page_size` consecutive slots of one (sequence, KV head). A step scores
every page, reads the best within the rule's count (kv/page_rule.py) plus the sink and recent pages, and attends
over those alone. The scores come from what the cache keeps on the compute device, where the query is:

    "keys":  every key again as an int4 row; a page scores the attention its best token gets from the query
             (softmax over the held keys, summed over the KV head's query heads: the compressed-cache kernel)
    "bound": per page and channel the least and largest key value (Quest, arXiv 2406.10774); no key of page j can
             score above sum_c max(q_c * kmin_c, q_c * kmax_c) (the largest over the group's query heads)

The bound is loose on RoPE keys and loses needles (docs/page-selection.md "Two scores"). Only the chosen pages are
read from the tier: one gather of whole pages, which on the disk tier touches those pages' bytes of the file and
no others (memory/tier.py maps KV files for random access), and on a GPU with host-homed KV only they cross.

The layer never sees a tier: the view `stage` returns is lazy (KVView.select), and the attention layer hands it
the step's query, which returns an ordinary view of the chosen pages (`docs/page-selection.md`).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from flexgen_h2o.formats import quant_format
from flexgen_h2o.kv.budget import Budget, RowBudgets
from flexgen_h2o.kv.cache import KVCache
from flexgen_h2o.kv.page_rule import PageRule
from flexgen_h2o.models.layer import KVView, LayerOutput
from flexgen_h2o.models.ops import write_slot


# the key copy a "keys" score reads: int4 rows of one group per head (min-max, formats.QuantFormat)
SKETCH = quant_format(4, 64)


def page_bounds(q: Tensor, summary: Tensor) -> Tensor:
    """Quest's bound per page, pooled over a KV head's query heads by their largest: q (b, g, r, d); summary
    (b, g, n, 2d), each page's per-channel max then min -> (b, g, n). max(q_c * lo, q_c * hi) is q_c * hi where
    q_c >= 0 and q_c * lo where it is not, so the bound is one batched product of [q+, q-] with [max, min], not an
    elementwise pass over every page."""
    signed = torch.cat((q.clamp(min=0), q.clamp(max=0)), dim=-1)
    return torch.matmul(signed, summary.transpose(-1, -2)).amax(dim=2)


def choose_pages(bounds: Tensor, filled: Tensor, n_read: Tensor, rule: PageRule) -> Tensor:
    """The pages each column reads, ascending, padded with -1 to the widest row's count.

    bounds (b, g, n) per page; filled (b,) pages each sequence has, the newest token's included; n_read (b,)
    pages each reads. The sink pages and the last recent_pages of a sequence always come first; then the best
    bounds, ties to the lower page (a stable sort: the choice depends on the sequence alone)."""
    b, g, n = bounds.shape
    page = torch.arange(n, device=bounds.device)
    filled = filled.view(b, 1, 1)
    forced = (page < rule.sink_pages) | (page >= filled - rule.recent_pages)
    ranked = torch.where(page >= filled, -math.inf, torch.where(forced, math.inf, bounds))
    width = int(n_read.max())
    best = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :, :width]
    taken = torch.arange(width, device=bounds.device) < n_read.view(b, 1, 1)
    return torch.where(taken, best, n).sort(dim=-1).values.masked_fill_(~taken, -1)


class PagedKVCache(KVCache):
    record_pages = False                # True: each cache logs every step's chosen pages (tests)

    def __init__(self, spec, batch: int, capacity: int, policy, budget: Budget | RowBudgets, *, pages: PageRule,
                 summary_device: torch.device | None = None, summary_dtype: torch.dtype = torch.float32, **kw):
        """pages: what a step reads; summary_device, summary_dtype: where the page summaries live and what the
        query is scored in (the compute device's, which scores them every step)."""
        super().__init__(spec, batch, capacity, policy, budget, **kw)
        self.rule = pages
        self.n_pages = -(-capacity // pages.page_size)
        d, g = spec.head_dim, spec.n_kv_heads
        device = self.k.device if summary_device is None else summary_device
        if pages.score == "bound":
            # per page and channel the largest key value, then the least: one tensor, so the bound is one product
            self.summary = torch.empty(batch, g, self.n_pages, 2 * d, dtype=summary_dtype, device=device)
            self.kmax, self.kmin = self.summary[..., :d], self.summary[..., d:]
            self.kmax.fill_(-math.inf)
            self.kmin.fill_(math.inf)
        else:
            # every held key in int4 rows (one slot more per column: where a prompt's pads land)
            self.summary = torch.zeros(batch, g, capacity + 1, SKETCH.row_width(d), dtype=SKETCH.dtype, device=device)
        self.score_dtype = summary_dtype
        self.length = [0] * batch       # tokens each sequence holds: slots [0, length) in position order
        self.page_log: list | None = [] if self.record_pages else None     # each step's chosen (b, g, n)

    @property
    def reads_ahead(self) -> bool:
        return self.rule.ahead

    @property
    def summary_bytes(self) -> int:
        return self.summary.nbytes

    # --- keeping the summaries ---

    def _attended(self, k_rows: Tensor, rows: slice) -> Tensor:
        """Keys (b, g, t, d) as attention reads them back from this cache (rounded to its format, a compressed
        cache's dequantized and scaled back), on the summaries' device and in their dtype."""
        d = self.spec.head_dim
        stored = self._stored(k_rows, self.k_scale, rows)
        keys = self.fmt.stage(stored, self.summary.device, self.score_dtype, n=d)
        if self.k_scale is not None:
            keys = keys * self.k_scale[rows].to(keys.device, keys.dtype)
        return keys

    def commit_prefill(self, k_new: Tensor, v_new: Tensor, scores: Tensor | None, token_pos: Tensor,
                       first_row: int = 0, unpadded: bool = False, key_scale: Tensor | None = None) -> None:
        """Every real prompt row (KVCache.commit_prefill under the full policy: slot i is the i-th real token),
        and each page's key summary from them."""
        super().commit_prefill(k_new, v_new, scores, token_pos, first_row, unpadded, key_scale)
        b, g, p, d = k_new.shape
        rows = slice(first_row, first_row + b)
        keys = self._attended(k_new, rows)
        pos = token_pos.to(keys.device)
        self.length[rows] = (token_pos >= 0).sum(1).tolist()
        if self.rule.score == "keys":            # each key's int4 row into its slot (pads: the spare last slot)
            slot = torch.where(pos >= 0, pos, self.capacity)[:, None, :, None]
            packed = SKETCH.pack(keys)
            self.summary[rows].scatter_(2, slot.expand(*packed.shape), packed)
            return
        page = torch.where(pos >= 0, pos // self.rule.page_size, self.n_pages)        # pads: a page past the end
        index = page[:, None, :, None].expand(b, g, p, d)
        for bound, reduce, fill in ((self.kmin, "amin", math.inf), (self.kmax, "amax", -math.inf)):
            part = torch.full((b, g, self.n_pages + 1, d), fill, dtype=bound.dtype, device=bound.device)
            bound[rows] = part.scatter_reduce_(2, index, keys, reduce)[:, :, :-1]

    def commit_decode(self, view: KVView, out: LayerOutput, new_pos: Tensor) -> None:
        """The new token's K/V row into its slot (each sequence's next), its position, and its page's summary.
        Nothing is scored or evicted."""
        self._write_token(view.write_slot.to(self.k.device), out, new_pos)
        keys = self._attended(out.k_new, slice(None))                                    # (b, g, 1, d)
        if self.rule.score == "keys":
            write_slot(self.summary, view.write_slot.to(keys.device), SKETCH.pack(keys))
        else:
            index = (view.write_slot.to(keys.device) // self.rule.page_size)[:, :, None, None].expand_as(keys)
            for bound, pick in ((self.kmin, torch.minimum), (self.kmax, torch.maximum)):
                bound.scatter_(2, index, pick(bound.gather(2, index), keys))
        self.length = [min(n + 1, self.capacity) for n in self.length]
        self.n_used = max(self.length)
        self.bytes_written[self.tier_kind] += self._slot_bytes(1)

    def reset_row(self, row: int, budget: Budget, draw_key: int | None = None) -> None:
        super().reset_row(row, budget, draw_key)
        if self.rule.score == "bound":       # (a sketch's rows past the new prompt's length are never read)
            self.kmin[row] = math.inf
            self.kmax[row] = -math.inf
        self.length[row] = 0

    def map_rows(self, fn) -> None:
        super().map_rows(fn)
        self.summary = fn(self.summary).contiguous()
        d = self.spec.head_dim
        if self.rule.score == "bound":
            self.kmax, self.kmin = self.summary[..., :d], self.summary[..., d:]
        self.length = fn(torch.tensor(self.length)).tolist()

    # --- a step's read ---

    def _held(self) -> list[int]:
        """Tokens before each sequence's new one, whose slot is the next. A refilled block's free row keeps taking
        steps past its prompt (schedule/refill.py): once full, it rewrites its last slot, which nothing reads."""
        return [min(n, self.capacity - 1) for n in self.length]

    def stage(self, device: torch.device, dtype: torch.dtype, new_rank: Tensor | None = None) -> KVView:
        """A lazy view: each sequence's write slot (its next), and `select`, which reads the pages a query needs.
        Nothing is read here: which pages a step needs is known only once its query is."""
        b, g, width = self.batch, self.spec.n_kv_heads, self.k.shape[-1]
        slot = torch.tensor(self._held(), dtype=torch.long).view(b, 1).expand(b, g).to(device)
        empty = torch.empty(b, g, 0, width, dtype=self.k.dtype, device=device)
        return KVView(k=empty, v=empty, valid=torch.zeros(b, g, 0, dtype=torch.bool, device=device),
                      write_slot=slot, compute_dtype=dtype, format=self.fmt,
                      select=functools.partial(self.select, device, dtype))

    def select(self, device: torch.device, dtype: torch.dtype, q: Tensor) -> KVView:
        """The view of the pages query q (b, h, 1, d) needs: their stored rows gathered into a (b, g, n * P,
        width) window in page order, read in place by attention as a copied window is (KVView.compute_dtype)."""
        return self.read(self.choose(q), device, dtype)

    def choose(self, q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The pages query q (b, h, 1, d) reads, scored where the summaries are (the compute device's part of
        `select`): chosen (b, g, n) pages on the host (-1: none), each sequence's page count and held tokens."""
        rule, P = self.rule, self.rule.page_size
        b, g = self.batch, self.spec.n_kv_heads
        held = self._held()
        filled_list = [-(-(n + 1) // P) for n in held]
        n_read_list = [rule.pages_read(n + 1) for n in held]
        filled, n_read = torch.tensor(filled_list), torch.tensor(n_read_list)
        if n_read_list == filled_list:       # every page: the full cache's window, in its order
            width = max(filled_list)
            chosen = torch.arange(width).expand(b, g, width)
            chosen = torch.where(chosen < filled.view(b, 1, 1), chosen, -1)
        else:
            top = max(filled_list)
            scores = self._key_scores(q, held, top) if rule.score == "keys" else self._bounds(q, top)
            chosen = choose_pages(scores, filled.to(scores.device), n_read.to(scores.device), rule).cpu()
        if self.page_log is not None:
            self.page_log.append(chosen.clone())
        return chosen, n_read, torch.tensor(held)

    def _bounds(self, q: Tensor, top: int) -> Tensor:
        """(b, g, top) Quest's bound of pages [0, top) for query q (b, h, 1, d)."""
        b, g = self.batch, self.spec.n_kv_heads
        qg = q.to(self.summary.device, self.score_dtype).reshape(b, g, -1, q.shape[-1])
        self.bytes_read["summaries"] += b * g * top * self.summary.shape[-1] * self.summary.element_size()
        return page_bounds(qg, self.summary[:, :, :top])

    def _key_scores(self, q: Tensor, held: list[int], top: int) -> Tensor:
        """(b, g, top) each page's best token by the attention query q (b, h, 1, d) gives the int4 copy of the held
        keys: softmax probabilities, summed over the KV head's query heads, by the attention kernel that reads a
        compressed cache (the new token joins as a zero key, so each head's softmax has the step's own row)."""
        b, g, d = self.batch, self.spec.n_kv_heads, self.spec.head_dim
        P = self.rule.page_size
        s = min(max(held) + 1, self.capacity)
        device = self.summary.device
        sketch = self.summary[:, :, :s]
        slot = torch.tensor(held, device=device).view(b, 1).expand(b, g).contiguous()
        valid = torch.arange(s, device=device).view(1, 1, s) <= slot[:, :, None]
        zero = torch.zeros(b, g, 1, d, dtype=self.score_dtype, device=device)
        qs = q.to(device, self.score_dtype)
        mass = self.kernels.key_mass(qs, sketch, valid, slot, zero, d ** -0.5, SKETCH)
        mass = mass.scatter(2, slot[:, :, None], 0.0)                         # the step's own row is no page's
        self.bytes_read["summaries"] += sum(n + 1 for n in held) * g * sketch.shape[-1]
        pad = top * P - s
        if pad > 0:
            mass = torch.nn.functional.pad(mass, (0, pad))
        return mass[:, :, :top * P].view(b, g, top, P).amax(dim=-1)

    def read(self, choice: tuple[Tensor, Tensor, Tensor], device: torch.device, dtype: torch.dtype) -> KVView:
        """The view of the pages `choose` picked (the KV lane's part of `select`): whole pages `chosen` (b, g, n)
        (-1: none) of each column gathered from the tier, in one index per tensor. A missing page reads the
        column's first page again (already read: no new bytes from a disk)."""
        chosen, n_read, held = choice
        P = self.rule.page_size
        b, g, n = chosen.shape
        cap, width = self.capacity, self.k.shape[-1]
        offset = torch.arange(P)
        slots = (chosen.clamp(min=0)[..., None] * P + offset).view(b, g, n * P)            # (b, g, n * P)
        length = held.view(b, 1, 1)
        column = torch.arange(b * g).view(b, g, 1) * cap
        rows = (column + slots.clamp(max=cap - 1)).view(-1).to(self.k.device)
        k = self.k.view(-1, width).index_select(0, rows).view(b, g, n * P, width).to(device)
        v = self.v.view(-1, width).index_select(0, rows).view(b, g, n * P, width).to(device)
        valid = ((chosen >= 0)[..., None].expand(b, g, n, P).reshape(b, g, n * P) & (slots < length)).to(device)
        # the newest token's page is the last chosen one (it is a recent page): its slot lands there
        write = ((n_read - 1) * P + held % P).view(b, 1).expand(b, g).to(device)
        read_pages = int(n_read.sum()) * g
        self.bytes_read[self.tier_kind] += read_pages * P * 2 * width * self.k.element_size()
        return KVView(k=k, v=v, valid=valid, write_slot=write, compute_dtype=dtype, format=self.fmt,
                      key_scale=None if self.k_scale is None else self.k_scale.to(device))
