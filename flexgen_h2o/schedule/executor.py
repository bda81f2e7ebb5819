"""BlockExecutor: walks the zig-zag Steps for one block; the only place a step meets weights, caches and layers.

Transfers run on named lanes of memory.Transfer: with overlap, each lane is one FIFO worker (inside the
backend's stream for that lane on CUDA), so a lane's operations stay in issue order, and a compute step waits
for exactly the futures it consumes. KV loads and stores share one lane, so a cache is never staged before its
previous update landed. A worker's exception is re-raised at the next SYNC, never swallowed. Without overlap
every step runs inline, in order, which keeps the loop easy to debug. Buffers are one-slot ValueHolders:
storing into a full slot or popping an empty one raises, which catches ordering bugs loudly.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from flexgen_h2o.memory import Transfer, ValueHolder
from flexgen_h2o.models.layer import StepContext
from flexgen_h2o.models.ops import TORCH, TorchKernels
from flexgen_h2o.schedule.zigzag import Op, Step, block_schedule


@dataclass
class BatchState:
    """One GPU batch of the block."""
    seq_index: list[int]                 # indices of its sequences in the caller's prompt list
    prompt_ids: Tensor                   # (b, p) left-padded
    token_valid: Tensor                  # (b, p) bool
    real_len: Tensor                     # (b,) real prompt tokens
    kept_max: Tensor | None = None       # (b,) each sequence's budget: kept tokens before the current one
    caches: dict[int, Any] = field(default_factory=dict)     # layer index -> SplitKVCache
    activations: Any = None              # where the hidden state rests between layers
    next_ids: Tensor | None = None       # (b,) ids sampled at the last token step
    ctx: Any = None                      # (token, StepContext, decode_pos) once per token step, for its layers
    # continuous refill: the token step at which each row's prompt ran (None: step 0 for every row)
    first_step: Tensor | None = None
    live: Tensor | None = None           # continuous refill: the rows holding a prompt, when some are free
    # whether each row's own budget evicts (its prompt pass is scored); None: every row, as the rule says
    evicts: tuple[bool, ...] | None = None

    def decode_pos(self, token: int) -> Tensor:
        """(b,) original position of the token each row feeds at step `token` (its first is real_len)."""
        start = 0 if self.first_step is None else self.first_step
        return self.real_len + (token - 1) - start


@dataclass
class RunParts:
    backend: Any                         # flexgen_h2o.backend.Backend: lanes and device
    layers: list                         # flat layer list
    groups: list[list[int]]              # schedule layers (sep_layer: one model layer each)
    weights: Any                         # WeightPlacement
    device: torch.device
    compute_dtype: torch.dtype
    needs_scores: bool
    rolling: bool
    score_reduce: str
    prefill_rows: int                    # sequences per layer forward at prefill (OffloadPolicy.prefill_rows)
    on_logits: Callable[[int, int, Tensor], None]   # (token, batch, logits (b, V)) -> stores next ids
    should_stop: Callable[[int], bool]   # after token i: every sequence finished?
    async_lanes: frozenset = frozenset({"weights", "kv"})   # lanes that get a worker thread when overlapping
    prefill_by_rows: bool = False        # token 0 chunk by chunk through every layer (OffloadPolicy.prefill_by_rows)
    kernels: TorchKernels = TORCH        # the engine's flexgen_h2o.kernels.Kernels, resolved once (default: torch)
    link: Any = None                     # a pipeline stage's StageLink: hidden states in and out, ids back
    score_window: int | None = None      # the prompt's last queries that score its keys (EvictionConfig.score_window)


class BlockExecutor:
    def __init__(self, parts: RunParts, batches: list[BatchState], n_tokens: int, overlap: bool,
                 first_token: int = 0, batch_major: bool = False):
        """first_token 1: the prompt pass already ran (Engine.generate(prefilled=...)); decode from step 1.
        batch_major: zigzag._batch_major's order (a pipeline stage with resident weights), without overlap."""
        self.p, self.batches, self.n_tokens, self.first = parts, batches, n_tokens, first_token
        self.overlap, self.batch_major = overlap and not batch_major, batch_major
        self.transfer = Transfer(parts.backend) if self.overlap and parts.async_lanes else None
        self.in_flight: list[Future] = []
        n_groups, n_batches = len(parts.groups), len(batches)
        self.weight_buf = [ValueHolder(f"weights of schedule layer {j}") for j in range(n_groups)]
        self.kv_buf = [[ValueHolder(f"KV of layer {j} batch {k}") for k in range(n_batches)] for j in range(n_groups)]
        self.store_buf = [[ValueHolder(f"KV update of layer {j} batch {k}") for k in range(n_batches)]
                          for j in range(n_groups)]
        self.hidden_buf = [ValueHolder(f"hidden of batch {k}") for k in range(n_batches)]
        self.attn_of = [[l for l in group if parts.layers[l].kind == "attn"] for group in parts.groups]
        # page selection reading a layer ahead (PageRule.ahead): only in the overlapped order, which stages the next
        # layer's weights before this one computes
        self.reads_ahead = self.overlap and any(c.reads_ahead for b in batches for c in b.caches.values())
        self.ahead: dict[tuple[int, int], Any] = {}      # (layer, batch) -> its pages, read a layer ahead
        self.committed: dict[tuple[int, int], Any] = {}  # (schedule layer, batch) -> its last KV commit (future)
        self.token_times: list[float] = []

    # --- the loop ---

    def run(self) -> list[float]:
        """Execute every step; returns the wall time at the end of each token step."""
        p = self.p
        last_batch, last_group = len(self.batches) - 1, len(p.groups) - 1
        try:
            if self.first == 0 and p.prefill_by_rows:
                self._prefill_by_rows()
                self.token_times.append(time.perf_counter())
                if p.should_stop(0):
                    return self.token_times
                self.first = 1
            steps = block_schedule(self.n_tokens, len(p.groups), len(self.batches), overlap=self.overlap,
                                   batch_major=self.batch_major, start=self.first)
            for step in steps:
                self._dispatch(step)
                if step.op is Op.COMPUTE and step.layer == last_group and step.batch == last_batch:
                    self.token_times.append(time.perf_counter())
                    if p.should_stop(step.token):
                        break
            if self.transfer is not None:
                self.transfer.synchronize()
        finally:
            if self.transfer is not None:
                self.transfer.close()
            self.ahead.clear()
            self._drain_weights()
        return self.token_times

    def _drain_weights(self) -> None:
        """Give back weights still staged when the loop stops early (all sequences done, or an error)."""
        for holder in self.weight_buf:
            if holder.is_full:
                value = holder.pop()
                if isinstance(value, Future) and (value.cancelled() or value.exception() is not None):
                    continue
                for staged in self._ready(value).values():
                    self.p.weights.release(staged)

    def _ready(self, value: Any) -> Any:
        """A holder's value, waiting for it (host, then device stream) if a lane is still producing it."""
        return self.transfer.collect(value) if isinstance(value, Future) else value

    def _submit(self, lane: str, fn, *args) -> Any:
        if self.transfer is None or lane not in self.p.async_lanes:
            return fn(*args)          # inline: in step order, so a cache still never stages before its commit
        fut = self.transfer.submit(lane, fn, *args)
        self.in_flight.append(fut)
        return fut

    def _surface_errors(self) -> None:
        """SYNC: re-raise a finished worker's exception here; compute waits on its own inputs only, so the next
        layer's weights keep streaming during every batch of this layer (FlexGen's sync-all allows one)."""
        still = []
        for fut in self.in_flight:
            if fut.done():
                fut.result()
            else:
                still.append(fut)
        self.in_flight = still

    def _dispatch(self, step: Step) -> None:
        op, i, j, k = step.op, step.token, step.layer, step.batch
        if op is Op.LOAD_WEIGHT:
            self.weight_buf[j].store(self._submit("weights", self._stage_weights, j))
        elif op is Op.FREE_WEIGHT:
            for staged in self._ready(self.weight_buf[j].pop()).values():
                self.p.weights.release(staged)           # its buffers may now stage a later layer
        elif op is Op.LOAD_KV:
            if i > 0 and self._attn_layers(j):
                self.kv_buf[j][k].store(self._submit("kv", self._stage_kv, j, k, i))
        elif op is Op.LOAD_HIDDEN:
            self.hidden_buf[k].store(self._load_hidden(i, j, k))
        elif op is Op.COMPUTE:
            self._compute(i, j, k)
        elif op is Op.STORE_KV:
            if self.store_buf[j][k].is_full:
                done = self._submit("kv", self._commit_kv, j, k, i, self.store_buf[j][k].pop())
                if self.reads_ahead:                     # a read ahead of this layer waits for it (_read_ahead)
                    self.committed[(j, k)] = done
        elif op is Op.STORE_HIDDEN:
            pass                                   # outputs are homed inside _compute (see _store_hidden)
        elif op is Op.SYNC:
            self._surface_errors()

    # --- step bodies ---

    def _attn_layers(self, group: int) -> list[int]:
        return self.attn_of[group]

    def _stage_weights(self, group: int) -> dict[int, Any]:
        return {l: self.p.weights.stage(l) for l in self.p.groups[group]}

    def _stage_kv(self, group: int, batch: int, token: int) -> dict[int, Any]:
        b = self.batches[batch]
        rank = self._new_rank(b, token) if self.p.rolling else None
        return {l: b.caches[l].stage(self.p.device, self.p.compute_dtype, rank) for l in self._attn_layers(group)}

    def _new_rank(self, b: BatchState, token: int, true_pos: Tensor | None = None) -> Tensor:
        # the new token ranks after every kept token: min(tokens before it, its budget) of them survive
        return torch.minimum(b.decode_pos(token) if true_pos is None else true_pos, b.kept_max)

    def _load_hidden(self, token: int, group: int, batch: int) -> Tensor:
        b = self.batches[batch]
        if group == 0 and self.p.link is not None and not self.p.link.first:     # from the previous stage
            return self.p.link.recv_hidden(len(b.seq_index), b.prompt_ids.shape[1] if token == 0 else 1)
        if group == 0:                              # embed input: token ids
            ids = b.prompt_ids if token == 0 else b.next_ids.view(-1, 1)
            return ids.to(self.p.device)
        return b.activations.load()

    def _context(self, b: BatchState, token: int, true_pos: Tensor | None = None) -> StepContext:
        """The step's context; true_pos: a decode step's b.decode_pos(token), computed once by its caller."""
        p = self.p
        if token == 0:
            positions = (b.token_valid.long().cumsum(1) - 1).masked_fill(~b.token_valid, -1)
            return StepContext(positions.to(p.device), b.token_valid.to(p.device), p.compute_dtype,
                               want_scores=p.needs_scores, keys_pre_rope=p.rolling, score_reduce=p.score_reduce,
                               score_window=p.score_window, unpadded=bool(b.token_valid.all()), kernels=p.kernels,
                               pad_counts=StepContext.leading_pads(b.token_valid.cpu()), score_rows=b.evicts)
        pos = self._new_rank(b, token, true_pos) if p.rolling else true_pos
        valid = torch.ones(len(true_pos), 1, dtype=torch.bool)
        return StepContext(pos.view(-1, 1).to(p.device), valid.to(p.device), p.compute_dtype,
                           want_scores=p.needs_scores, keys_pre_rope=p.rolling, score_reduce=p.score_reduce,
                           kernels=p.kernels, live=None if b.live is None else b.live.to(p.device))

    def _compute(self, token: int, group: int, batch: int) -> None:
        b = self.batches[batch]
        weights = self._ready(self.weight_buf[group].peek())
        x = self.hidden_buf[batch].pop()
        if b.ctx is None or b.ctx[0] != token:
            new_pos = None if token == 0 else b.decode_pos(token)
            b.ctx = (token, self._context(b, token, new_pos), new_pos)
        _, ctx, new_pos = b.ctx
        if token == 0:
            x = self._prefill(b, group, weights, x, ctx)
        else:
            views = self._ready(self.kv_buf[group][batch].pop()) if self._attn_layers(group) else {}
            if self.reads_ahead:
                self._read_ahead(group, batch, x, ctx)
            updates = {}
            for l in self.p.groups[group]:
                layer = self.p.layers[l]
                view = views.get(l)
                if self.reads_ahead and (l, batch) in self.ahead:      # its pages, read during the layer before
                    view = self._ready(self.ahead.pop((l, batch)))
                out = layer.forward(x, weights[l], view, ctx)
                if layer.kind == "attn":
                    updates[l] = (views[l], out, new_pos)
                x = out.hidden
            if updates:
                self.store_buf[group][batch].store(updates)
        link = self.p.link
        if self.p.layers[self.p.groups[group][-1]].kind == "head":
            self.p.on_logits(token, batch, x)
            if link is not None:                    # every other stage tracks the same stops from these ids
                link.send_ids(b.next_ids)
        elif link is not None and group == len(self.p.groups) - 1:
            link.send_hidden(x)
        else:
            b.activations.store(x)

    def _read_ahead(self, group: int, batch: int, x: Tensor, ctx: StepContext) -> None:
        """InfiniGen's read ahead (kv/page_rule.py PageRule.ahead): the next schedule layer's attention, where its
        cache reads pages a layer ahead, makes its query of this layer's input x with its own weights (staged
        before this layer computes, in the overlapped order), chooses its pages here, once that cache's last
        commit is done, and the KV lane reads them while this layer computes. Not from the embedding's input,
        which is token ids."""
        nxt = group + 1
        if nxt >= len(self.p.groups) or self.p.layers[self.p.groups[group][0]].kind == "embed":
            return
        b = self.batches[batch]
        todo = [l for l in self._attn_layers(nxt) if l in b.caches and b.caches[l].reads_ahead]
        if not todo:
            return
        weights = self._ready(self.weight_buf[nxt].peek())
        self._ready(self.committed.get((nxt, batch)))
        for l in todo:
            choice = b.caches[l].choose(self.p.layers[l].query(x, weights[l], ctx))
            self.ahead[(l, batch)] = self._submit("kv", b.caches[l].read, choice, self.p.device,
                                                  self.p.compute_dtype)

    def _prompt_chunk(self, b: BatchState, layer_ids: list[int], weights: dict, h: Tensor, ctx, lo: int) -> Tensor:
        """Sequences [lo, lo + len(h)) of the prompt through `layer_ids`; each attention layer's prompt KV is
        committed before the chunk moves on, so the transients are one chunk's, whatever the GPU batch."""
        sub = ctx.rows(lo, lo + h.shape[0])
        for l in layer_ids:
            layer = self.p.layers[l]
            out = layer.forward(h, weights[l], None, sub)
            if layer.kind == "attn":
                b.caches[l].commit_prefill(out.k_new, out.v_new, out.scores, sub.positions, first_row=lo,
                                           unpadded=sub.unpadded)
            h = out.hidden
        return h

    def _prefill_by_rows(self) -> None:
        """Token 0 with every weight resident: each chunk of `prefill_rows` sequences goes through all layers
        before the next starts, so no GPU batch's prompt hidden state rests between layers."""
        p = self.p
        staged: list[dict] = []
        try:
            for j in range(len(p.groups)):       # inside the try: a failed stage still gives back the earlier ones
                staged.append(self._stage_weights(j))
            weights = {l: w for group in staged for l, w in group.items()}
            every_layer = [l for group in p.groups for l in group]
            for k, b in enumerate(self.batches):
                ctx = self._context(b, 0)
                ids = b.prompt_ids.to(p.device)
                logits = [self._prompt_chunk(b, every_layer, weights, ids[lo:lo + p.prefill_rows], ctx, lo)
                          for lo in range(0, ids.shape[0], p.prefill_rows)]
                p.on_logits(0, k, logits[0] if len(logits) == 1 else torch.cat(logits))
        finally:
            for group in staged:
                p.weights.release(group)

    def _prefill(self, b: BatchState, group: int, weights: dict, x: Tensor, ctx) -> Tensor:
        """The prompt through one schedule layer, `prefill_rows` sequences at a time (_prompt_chunk).
        Residual layers write their output back into x's rows; the embed and head layers fill a new tensor."""
        n = x.shape[0]
        result = None
        for lo in range(0, n, self.p.prefill_rows):
            hi = min(n, lo + self.p.prefill_rows)
            h = self._prompt_chunk(b, self.p.groups[group], weights, x[lo:hi], ctx, lo)
            if hi - lo == n:
                return h                             # one chunk: nothing to assemble
            if result is None:
                same = h.shape[1:] == x.shape[1:] and h.dtype == x.dtype
                result = x if same else h.new_empty((n, *h.shape[1:]))
            result[lo:hi] = h
        return result

    def _commit_kv(self, group: int, batch: int, token: int, updates: dict) -> None:
        b = self.batches[batch]
        for l, (view, out, pos) in updates.items():
            b.caches[l].commit_decode(view, out, pos)
            if view.release is not None:
                view.release()
