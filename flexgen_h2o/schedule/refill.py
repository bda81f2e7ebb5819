"""Continuous refill: one block of rows stays allocated for the whole job, and a row whose prompt is
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
(StepContext.live) and its attention reads only its own slots. A GPU batch whose rows are all free sits the
decode steps out, and joins fill the busiest GPU batches first, so at the job's tail (nothing left to join) whole
GPU batches stop computing. Join passes and decode phases are runs of the one block path (schedule/block.py), so a
pipeline stage refills too: every stage gets the ids the last stage sampled and makes the same joins.

The refill rule: join once `share` of the rows are free (or as many as there are prompts left, or every row);
share defaults to a quarter of the block (DEFAULT_SHARE: fewer, fuller join passes beat joining at the first
free row, and where weights stream in each join reads every weight once more; docs/architecture.md, "Continuous
refill"). Joiners are prefilled in groups of similar length, so a join pads little. A prompt's text does not depend on which row it took, what it
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

from flexgen_h2o.config import GenerationConfig, split_by_fraction
from flexgen_h2o.kv.draws import KeyedDraws, sequence_key
from flexgen_h2o.planner.job import JobPlan
from flexgen_h2o.sampling import Sampler, StopTracker
from flexgen_h2o.schedule.activations import ActivationHome
from flexgen_h2o.schedule.block import Runtime
from flexgen_h2o.schedule.executor import BatchState


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
    reads_ahead = False     # a prompt pass reads no pages

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


# The refill rule's default: wait for a quarter of the block's rows. A free row waiting costs its attention only
# (its linear layers are skipped), a join pass costs a pass over every weight: where weights stream in, more
# (docs/architecture.md, "Continuous refill").
DEFAULT_SHARE = 0.25


class RefillRun:
    def __init__(self, runtime: Runtime, job: JobPlan, prompts: Sequence[Sequence[int]], gen: GenerationConfig,
                 seeds: Sequence[int] | None, model: Any, decode: Callable[[list[int]], str] | None,
                 share: float | None = None, on_tokens: Callable[[int], None] | None = None,
                 hook: Callable[[], Callable | None] = lambda: None):
        """job: the refilled plan of `prompts` (planner/job.plan_job(refill=True)), which join in the given order.
        seeds: each prompt's sampling key (default its index). share: the refill rule's free share of rows
        (default DEFAULT_SHARE). on_tokens(n): n more tokens were generated. hook(): the engine's per-step logits
        hook at the time of the call (Engine.on_step_logits), or None."""
        self.runtime, self.job, self.prompts = runtime, job, [list(p) for p in prompts]
        self.gen, self.model, self.hook = gen.validate(), model, hook
        n = len(self.prompts)
        self.max_new = list(job.max_new)
        self.ev = job.eviction
        self.share = DEFAULT_SHARE if share is None else share
        self.on_tokens = on_tokens
        self.sampler = Sampler(self.gen, list(seeds) if seeds is not None else list(range(n)))
        self.stops = StopTracker(n, self.gen, model.eos_id, decode, self.max_new)
        self.metrics = {"prefill_s": 0.0, "decode_s": 0.0, "prompt_tokens": 0, "generated_tokens": 0,
                        "decode_steps": 0, "joins": 0, "busy_row_steps": 0, "row_steps": 0}

    # --- setup ---

    def _allocate(self) -> None:
        """The one block of rows, allocated for the job's widest budget; rows hold no prompt yet (length-1
        placeholders) and the random rule's per-row keys are set to each prompt's as it joins (reset_row)."""
        self.plan = plan = self.job.plans[0]
        n = plan.n_seqs
        random = self.ev.policy == "random"
        self.batches = self.runtime.allocate(plan, torch.zeros(n, 1, dtype=torch.long),
                                             torch.ones(n, 1, dtype=torch.bool),
                                             lambda l, lo, hi: KeyedDraws([0] * (hi - lo)) if random else None,
                                             refill=True)
        for b in self.batches:
            b.next_ids = torch.zeros(len(b.seq_index), dtype=torch.long)
        self.row_seq: list[list[int | None]] = [[None] * b.real_len.shape[0] for b in self.batches]

    def caches(self) -> list[dict]:
        """The block's caches (each GPU batch's, by layer), for inspection after the run."""
        return [b.caches for b in self.batches]

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

    def _join(self, rows: list[tuple[int, int]]) -> None:
        """The prompt pass of the next waiting prompts in the given free rows (GPU batch, row). Joiners of one GPU
        batch go through it in groups of similar length, each group left-padded to its longest (at most
        JOIN_PADDING of its tokens pads), so a join of prompts of mixed lengths computes little padding."""
        taken = {(k, r): self.queue.popleft() for k, r in rows}
        joins, owners = [], []
        mark = self.runtime.mark()
        for k in sorted({k for k, _ in rows}):
            mine = sorted((len(self.prompts[s]), r, s) for (kk, r), s in taken.items() if kk == k)
            for group in _similar_lengths(mine):
                rs, seqs = [r for _, r, _ in group], [s for _, _, s in group]
                joins.append(self._join_batch(k, rs, seqs))
                owners.append((k, rs))
        self._run_join(joins, owners, mark)

    def _join_batch(self, k: int, rs: list[int], seqs: list[int]) -> BatchState:
        """Free block rows `rs` of GPU batch k for prompts `seqs`, and the join batch that prefills them."""
        main = self.batches[k]
        width = max(len(self.prompts[s]) for s in seqs)
        pad = self.model.pad_id if self.model.pad_id is not None else 0
        ids = torch.full((len(rs), width), pad, dtype=torch.long)
        valid = torch.zeros(len(rs), width, dtype=torch.bool)
        evicts = []
        for i, (r, s) in enumerate(zip(rs, seqs)):
            p = self.prompts[s]
            ids[i, width - len(p):] = torch.tensor(p)
            valid[i, width - len(p):] = True
            budget = self.job.budgets[s]
            evicts.append(budget.evicts)
            for l, cache in main.caches.items():
                key = sequence_key(self.ev.seed, l, p) if self.ev.policy == "random" else None
                cache.reset_row(r, budget, key)
            main.real_len[r], main.first_step[r], main.kept_max[r] = len(p), self.token, budget.budget
            self.row_seq[k][r] = s
        j = BatchState(seq_index=seqs, prompt_ids=ids, token_valid=valid, real_len=valid.sum(1),
                       caches={l: RowSlots(c, rs) for l, c in main.caches.items()}, evicts=tuple(evicts))
        rt = self.runtime
        j.activations = ActivationHome(split_by_fraction(len(rs), rt.offload.tier_fractions("act")), rt.alloc,
                                       rt.device)
        self.metrics["prompt_tokens"] += len(rs) * width
        return j

    def _run_join(self, joins: list[BatchState], owners: list[tuple[int, list[int]]], mark: int) -> None:
        def on_logits(token: int, batch: int, logits: torch.Tensor) -> None:
            k, rs = owners[batch]
            seqs = joins[batch].seq_index
            joins[batch].next_ids = ids = self.sampler(logits, list(seqs))    # a stage's link sends them on
            self._took(k, rs, seqs, ids, logits)

        def on_ids(token: int, batch: int, ids: torch.Tensor) -> None:      # a pipeline stage without the head
            k, rs = owners[batch]
            self._took(k, rs, joins[batch].seq_index, ids)

        t0 = time.perf_counter()
        try:
            self.runtime.run(self.plan, joins, 1, on_logits=on_logits, on_ids=on_ids, should_stop=lambda token: True)
        finally:                   # the join batches' resting hidden states, if any lived off the compute tier
            self.runtime.free_since(mark)
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
            seqs = self.row_seq[k]
            self._took(k, list(range(len(seqs))), seqs, self.sampler(logits, list(seqs)), logits, token)

        def on_ids(token: int, batch: int, ids: torch.Tensor) -> None:      # a pipeline stage without the head
            k = live[batch]
            self._took(k, list(range(len(self.row_seq[k]))), self.row_seq[k], ids, None, token)

        def should_stop(token: int) -> bool:
            self.token = token
            busy = sum(s is not None for rows in self.row_seq for s in rows)
            self.metrics["busy_row_steps"] += busy + len(self._just_freed)
            self.metrics["row_steps"] += sum(len(self.row_seq[k]) for k in live)
            self._just_freed = []
            return bool(self.finished) or busy == 0

        self._just_freed: list = []
        t0 = time.perf_counter()
        times = self.runtime.run(self.plan, [self.batches[k] for k in live], first + max(left), on_logits=on_logits,
                                 on_ids=on_ids, should_stop=should_stop, first_token=first)
        self.metrics["decode_s"] += time.perf_counter() - t0
        self.metrics["decode_steps"] += len(times)

    def _took(self, k: int, rows: list[int], seqs: Sequence[int | None], ids: torch.Tensor,
              logits: torch.Tensor | None = None, token: int | None = None) -> None:
        """Record each row's next id for its prompt and hand out the prompts that finished. logits: what the ids
        were sampled from (None on a pipeline stage without the head); token: the decode step (None: a join
        pass, whose rows' first decode step comes next)."""
        main = self.batches[k]
        hook = self.hook() if logits is not None else None
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
