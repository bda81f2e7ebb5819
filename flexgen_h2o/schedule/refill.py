"""Continuous refill (issue 35): one block of rows stays allocated for the whole job, and a row whose prompt is
done takes the next waiting prompt in its slots.

    rows  0 [ prompt 0 ......... eos ][ prompt 6 ....... ][ prompt 9 ...
          1 [ prompt 1 .... eos ][ prompt 5 ......... eos ][ prompt 8 ...
          2 [ prompt 2 ............................. length ]  (idle)
    join passes ^ 0-3                ^ 5, 6                 ^ 8, 9

The job alternates two phases on the same caches. A join pass is the prompt pass of the rows that take new
prompts, run by the BlockExecutor as a block's token 0 over those rows only, so every layer's weights are staged
once for all of them; each row's prompt KV is committed into its own slots (the previous prompt's slots were
freed in place by KVCache.reset_row: nothing is copied or reallocated). Then decode steps run every row of the
block, each at its own position (BatchState.first_step), with its own budget, sampler and stop state, until
a prompt finishes (its result is handed out) or the refill rule calls the next join. A free row stays in its
GPU batch until it is refilled, its token ignored and its position held at 1, but skips the linear layers
(StepContext.live) and its attention reads only its own slots. A GPU batch whose rows are all free sits the decode steps out, and joins fill the busiest
GPU batches first, so at the job's tail (nothing left to join) whole GPU batches stop computing.

The refill rule: join once `share` of the rows are free (or as many as there are prompts left, or every row);
share defaults to a quarter of the block (DEFAULT_SHARE: fewer, fuller join passes measured faster than joining at
the first free row, and where weights stream in each join reads every weight once more). Joiners are prefilled
in groups of similar length, so a join pads little. A prompt's text does not depend on which row it took, what it
shared the block with or when it joined: every kernel computes each row alone (tests/test_refill.py checks it
against each prompt run alone).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from flexgen_h2o.config import ConfigError, GenerationConfig, split_by_fraction
from flexgen_h2o.kv import EvictionConfig, get_policy
from flexgen_h2o.kv.draws import KeyedDraws, sequence_key
from flexgen_h2o.memory import check_space
from flexgen_h2o.planner.plan import Plan
from flexgen_h2o.sampling import Sampler, StopTracker
from flexgen_h2o.schedule.activations import ActivationHome
from flexgen_h2o.schedule.executor import BatchState, BlockExecutor, RunParts


@dataclass
class Finished:
    """One prompt's result, handed out as soon as it is done."""
    index: int                 # the prompt's index in the job
    token_ids: list[int]
    text: str
    finish_reason: str


class RowSlots:
    """One layer's cache seen through a join pass: row i of the join batch is row rows[i] of the block's batch.
    A join pass only commits prompt KV (its token 0 stages nothing)."""

    def __init__(self, cache: Any, rows: list[int]):
        self.cache, self.rows = cache, rows

    def commit_prefill(self, k_new, v_new, scores, token_pos, first_row: int = 0, unpadded: bool = False,
                       key_scale=None) -> None:
        i = 0
        while i < k_new.shape[0]:            # runs of consecutive block rows commit together
            j = i + 1
            while j < k_new.shape[0] and self.rows[first_row + j] == self.rows[first_row + j - 1] + 1:
                j += 1
            cut = slice(i, j)
            self.cache.commit_prefill(k_new[cut], v_new[cut], None if scores is None else scores[cut],
                                      token_pos[cut], first_row=self.rows[first_row + i], unpadded=unpadded,
                                      key_scale=None if key_scale is None else key_scale[cut])
            i = j


JOIN_PADDING = 0.1          # the share of a join group's prompt tokens that may be padding


def _similar_lengths(items: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """(length, ...) items sorted by length, cut into runs padded to their longest with at most JOIN_PADDING pads."""
    groups: list[list[tuple[int, int, int]]] = []
    for item in items:
        run = groups[-1] + [item] if groups else None
        if run and item[0] * len(run) - sum(x[0] for x in run) <= JOIN_PADDING * item[0] * len(run):
            groups[-1] = run
        else:
            groups.append([item])
    return groups


# The refill rule's default: wait for a quarter of the block's rows. On the chat workload (SmolLM2, H2O 20 %, one
# GPU batch of 128, weights resident), joining at the first free row took 57 join passes and 134 s of prompt
# passes, a quarter 4 passes and 120 s, 85.7 against 88.7 tok/s over the job (`python -m benchmarks.chat --systems
# ours-h2o-20-refill ours-h2o-20-refill-s25 --repeats 1`, one run each). A free row waiting costs its attention
# only (its linear layers are skipped), a join pass costs a pass over every weight: where weights stream in, more.
DEFAULT_SHARE = 0.25


class RefillRun:
    def __init__(self, engine: Any, prompts: Sequence[Sequence[int]], gen: GenerationConfig,
                 max_new: Sequence[int] | None, seeds: Sequence[int] | None, eviction: EvictionConfig | None,
                 share: float | None = None, on_tokens: Callable[[int], None] | None = None):
        """prompts join in the given order. seeds: each prompt's sampling key (default its index). share: the
        refill rule's free share of rows (default DEFAULT_SHARE). on_tokens(n): n more tokens were generated."""
        self.e, self.prompts = engine, [list(p) for p in prompts]
        self.gen = gen.validate()
        n = len(self.prompts)
        self.max_new = list(max_new) if max_new is not None else [self.gen.max_new_tokens] * n
        if len(self.max_new) != n or (seeds is not None and len(seeds) != n):
            raise ConfigError("max_new_tokens and seeds need one entry per prompt")
        if any(len(p) == 0 for p in self.prompts):
            raise ConfigError("empty prompt: every prompt needs at least one token")
        self.ev = engine._checked(eviction) if eviction is not None else engine.eviction
        if engine.check_context and not self.ev.position_rolling:
            for i, p in enumerate(self.prompts):
                if len(p) + self.max_new[i] > engine.model.max_seq_len:
                    raise ConfigError(f"prompt {i} ({len(p)}) + new tokens ({self.max_new[i]}) exceed the context "
                                      f"window ({engine.model.max_seq_len}) of {engine.model.name}; shorten it or "
                                      "use --position-rolling (Llama)")
        self.share = DEFAULT_SHARE if share is None else share
        self.on_tokens = on_tokens
        self.sampler = Sampler(self.gen, list(seeds) if seeds is not None else list(range(n)))
        self.stops = StopTracker(n, self.gen, engine.model.eos_id, engine.decode, self.max_new)
        self.metrics = {"prefill_s": 0.0, "decode_s": 0.0, "prompt_tokens": 0, "generated_tokens": 0,
                        "decode_steps": 0, "joins": 0, "busy_row_steps": 0, "row_steps": 0}

    # --- setup ---

    def _allocate(self) -> None:
        e = self.e
        lens = [len(p) for p in self.prompts]
        plan = Plan.for_refill(e.model, e.offload, self.ev, lens, self.max_new, device_type=e.device.type,
                               compute_itemsize=e.compute_dtype.itemsize)
        self.plan, self.policy = plan, get_policy(plan.policy)
        e.last_plan = plan
        e.release()
        e._handles.append(e.tiers["compute"].reserve(plan.layer_workspace(), "workspace (estimated)"))
        if "disk" in e.tiers:
            check_space(e.offload_dir.root, plan.disk_bytes())
        self.batches: list[BatchState] = []
        for bp in plan.batches:
            rows = plan.budgets.part(bp.lo, bp.hi)
            n = bp.size
            b = BatchState(seq_index=list(range(bp.lo, bp.hi)), prompt_ids=torch.zeros(n, 1, dtype=torch.long),
                           token_valid=torch.ones(n, 1, dtype=torch.bool), real_len=torch.ones(n, dtype=torch.long),
                           kept_max=torch.tensor(rows.values("budget")), first_step=torch.zeros(n, dtype=torch.long))
            # the random rule's per-row keys, set to each prompt's as it joins (reset_row)
            b.caches = {l: e._make_cache(layer, bp, rows, plan.capacity, self.policy,
                                         KeyedDraws([0] * n) if self.ev.policy == "random" else None,
                                         self.ev.position_rolling)
                        for l, layer in enumerate(e.layers) if layer.kind == "attn"}
            b.activations = ActivationHome(list(bp.act), e._alloc, e.device)
            b.next_ids = torch.zeros(n, dtype=torch.long)
            self.batches.append(b)
        self.row_seq: list[list[int | None]] = [[None] * b.real_len.shape[0] for b in self.batches]

    def _parts(self, on_logits, should_stop) -> RunParts:
        e, ev = self.e, self.ev
        return RunParts(backend=e.backend, layers=e.layers, groups=e.groups, weights=e.weights, device=e.device,
                        compute_dtype=e.compute_dtype, needs_scores=self.policy.needs_scores,
                        rolling=ev.position_rolling, score_reduce=ev.score_reduce,
                        prefill_rows=self.plan.prefill_rows, async_lanes=e._async_lanes(),
                        prefill_by_rows=self.plan.prefill_by_rows, kernels=e.kernels, on_logits=on_logits,
                        should_stop=should_stop)

    # --- the loop ---

    def run(self) -> Iterator[list[Finished]]:
        """Join, decode, hand out what finished, until every prompt is done."""
        self._allocate()
        self.queue = deque(range(len(self.prompts)))
        self.finished: list[Finished] = []
        self.token = 0                       # the last token step run (joins happen between steps)
        n_rows = sum(len(r) for r in self.row_seq)
        threshold = max(1, math.ceil(self.share * n_rows))
        while True:
            busy = [sum(s is not None for s in rows) for rows in self.row_seq]     # fill the busiest batches first
            free = [(k, r) for k in sorted(range(len(busy)), key=lambda k: -busy[k])
                    for r, s in enumerate(self.row_seq[k]) if s is None]
            if self.queue and len(free) >= min(threshold, len(self.queue)):
                self._join(free[:len(self.queue)])
            elif len(free) == n_rows:
                break                        # every row free and nothing waiting: done
            else:
                self._decode()
            if self.finished:
                out, self.finished = self.finished, []
                yield out
        self.e.last_caches = [b.caches for b in self.batches]

    def _join(self, rows: list[tuple[int, int]]) -> None:
        """The prompt pass of the next waiting prompts in the given free rows (GPU batch, row). Joiners of one GPU
        batch go through it in groups of similar length, each group left-padded to its longest (at most
        JOIN_PADDING of its tokens pads): one padded group of 128 chat prompts (83 to 540 tokens) computed 2.1x
        their real tokens (`python -m benchmarks.chat --systems ours-h2o-20-refill`, before the grouping)."""
        e = self.e
        taken = {(k, r): self.queue.popleft() for k, r in rows}
        joins, owners = [], []
        n_handles = len(e._handles)
        for k in sorted({k for k, _ in rows}):
            mine = sorted((len(self.prompts[s]), r, s) for (kk, r), s in taken.items() if kk == k)
            for group in _similar_lengths(mine):
                rs, seqs = [r for _, r, _ in group], [s for _, _, s in group]
                joins.append(self._join_batch(k, rs, seqs))
                owners.append((k, rs))
        self._run_join(joins, owners, n_handles)

    def _join_batch(self, k: int, rs: list[int], seqs: list[int]) -> BatchState:
        """Free block rows `rs` of GPU batch k for prompts `seqs`, and the join batch that prefills them."""
        e, main = self.e, self.batches[k]
        width = max(len(self.prompts[s]) for s in seqs)
        pad = e.model.pad_id if e.model.pad_id is not None else 0
        ids = torch.full((len(rs), width), pad, dtype=torch.long)
        valid = torch.zeros(len(rs), width, dtype=torch.bool)
        evicts = []
        for i, (r, s) in enumerate(zip(rs, seqs)):
            p = self.prompts[s]
            ids[i, width - len(p):] = torch.tensor(p)
            valid[i, width - len(p):] = True
            budget = self.ev.resolve(len(p), self.max_new[s])
            evicts.append(budget.evicts)
            for l, cache in main.caches.items():
                key = sequence_key(self.ev.seed, l, p) if self.ev.policy == "random" else None
                cache.reset_row(r, budget, key)
            main.real_len[r], main.first_step[r], main.kept_max[r] = len(p), self.token, budget.budget
            self.row_seq[k][r] = s
        j = BatchState(seq_index=seqs, prompt_ids=ids, token_valid=valid, real_len=valid.sum(1),
                       caches={l: RowSlots(c, rs) for l, c in main.caches.items()}, evicts=tuple(evicts))
        j.activations = ActivationHome(split_by_fraction(len(rs), e.offload.tier_fractions("act")), e._alloc,
                                       e.device)
        self.metrics["prompt_tokens"] += len(rs) * width
        return j

    def _run_join(self, joins: list[BatchState], owners: list[tuple[int, list[int]]], n_handles: int) -> None:
        e = self.e

        def on_logits(token: int, batch: int, logits: torch.Tensor) -> None:
            k, rs = owners[batch]
            self._sampled(k, rs, joins[batch].seq_index, logits)

        t0 = time.perf_counter()
        try:
            BlockExecutor(self._parts(on_logits, lambda token: True), joins, 1, e.offload.overlap).run()
        finally:                   # the join batches' resting hidden states, if any lived off the compute tier
            for handle in e._handles[n_handles:]:
                handle.free()
            del e._handles[n_handles:]
        self.metrics["prefill_s"] += time.perf_counter() - t0
        self.metrics["joins"] += 1

    def _decode(self) -> None:
        """Decode steps of the whole block from the next token until a prompt finishes (or all are done)."""
        first = self.token + 1
        left = [self.max_new[s] - len(self.stops.tokens[s]) for rows in self.row_seq for s in rows if s is not None]

        # a GPU batch with no prompt left sits the phase out: at a job's tail whole batches go idle (joins fill the
        # busiest batches first), and their rows would otherwise be computed for nothing
        live = [k for k, rows in enumerate(self.row_seq) if any(s is not None for s in rows)]
        for k in live:                       # and in a batch that runs, the free rows skip the linear layers
            busy = [r for r, s in enumerate(self.row_seq[k]) if s is not None]
            self.batches[k].live = None if len(busy) == len(self.row_seq[k]) else torch.tensor(busy)

        def on_logits(token: int, batch: int, logits: torch.Tensor) -> None:
            k = live[batch]
            self._sampled(k, list(range(len(self.row_seq[k]))), self.row_seq[k], logits, token)

        def should_stop(token: int) -> bool:
            self.token = token
            busy = sum(s is not None for rows in self.row_seq for s in rows)
            self.metrics["busy_row_steps"] += busy + len(self._just_freed)
            self.metrics["row_steps"] += sum(len(self.row_seq[k]) for k in live)
            self._just_freed = []
            return bool(self.finished) or busy == 0

        self._just_freed: list = []
        t0 = time.perf_counter()
        times = BlockExecutor(self._parts(on_logits, should_stop), [self.batches[k] for k in live], first + max(left),
                              self.e.offload.overlap, first_token=first).run()
        self.metrics["decode_s"] += time.perf_counter() - t0
        self.metrics["decode_steps"] += len(times)

    def _sampled(self, k: int, rows: list[int], seqs: Sequence[int | None], logits: torch.Tensor,
                 token: int | None = None) -> None:
        """Sample each row's next id, record it for its prompt, hand out the prompts that finished. token: the
        decode step (None: a join pass, whose rows' first decode step comes next)."""
        main = self.batches[k]
        ids = self.sampler(logits, list(seqs))
        hook = self.e.on_step_logits
        live = [(i, r, s) for i, (r, s) in enumerate(zip(rows, seqs)) if s is not None]
        for i, r, s in live:
            if hook is not None:
                hook(len(self.stops.tokens[s]), [s], logits[i:i + 1])
        self.stops.update([int(ids[i]) for i, _, _ in live], [s for _, _, s in live])
        main.next_ids[rows] = ids
        if self.on_tokens is not None and live:
            self.on_tokens(len(live))
        self.metrics["generated_tokens"] += len(live)
        for i, r, s in live:
            if self.stops.reasons[s] is not None:
                self.finished.append(Finished(s, self.stops.tokens[s], self.stops.text(s), self.stops.reasons[s]))
                self.row_seq[k][r] = None
                if token is not None:
                    self._just_freed.append((k, r))
        if token is not None:                # free rows hold position 1 (their tokens are never read)
            free = torch.tensor([s is None for s in self.row_seq[k]])
            main.real_len[free], main.first_step[free] = 1, token
