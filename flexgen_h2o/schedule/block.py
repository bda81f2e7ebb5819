"""The one block path: a block's caches, activation homes and GPU batches allocated from its Plan, and its token
steps run through the BlockExecutor.

Every job runs here. A synchronous FlexGen block (Engine.generate) allocates its rows with their prompts and runs
token 0 and the decode steps; a continuously refilled job (schedule/refill.py) allocates empty rows once and
alternates join passes (token 0 over the joining rows) with decode phases; a pipeline stage (distributed/
pipeline.py) does either with its link. What differs is only who samples and when a run stops: the caller's
`on_logits`, `on_ids` and `should_stop`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from flexgen_h2o.config import ConfigError, OffloadPolicy
from flexgen_h2o.kv import RowBudgets, get_policy
from flexgen_h2o.kv.staging import StagingBuffers
from flexgen_h2o.kv.draws import KeyedDraws
from flexgen_h2o.kv.mixed import SplitKVCache
from flexgen_h2o.kv.layouts import kv_cache
from flexgen_h2o.kv.page_rule import PageRule
from flexgen_h2o.memory import check_space
from flexgen_h2o.planner.plan import BatchPlan, Plan
from flexgen_h2o.schedule.activations import ActivationHome
from flexgen_h2o.schedule.executor import BatchState, BlockExecutor, RunParts

# a layer's random-rule draws for rows [lo, hi) of the block (None: the rule draws nothing)
DrawsFor = Callable[[int, int, int], "KeyedDraws | None"]


@dataclass
class Runtime:
    """What every block of one engine runs on, built once by the Engine: the backend, the layers of this process
    (a pipeline stage's range), their weights, the kernels chosen once, the tiers, and a stage's link. It holds
    the tier allocations of the current block, freed by release()."""
    backend: Any                         # flexgen_h2o.backend.Backend
    layers: list                         # the flat layer list (another stage's layers are ElsewhereLayer)
    groups: list[list[int]]              # this process's schedule layers
    stage: tuple[int, int]               # [lo, hi) of the flat layer list this process holds
    weights: Any                         # WeightPlacement
    kernels: Any                         # flexgen_h2o.kernels.Kernels
    offload: OffloadPolicy
    tiers: dict[str, Any]                # "compute", "host" and, with an offload folder, "disk"
    offload_root: str | None = None
    kv_staging: StagingBuffers | None = None
    # attention on the host where a cache is host- or disk-homed (cpu_cache_compute) even when the compute
    # device is the CPU: tests take that path on a machine with no GPU
    host_attention_on_cpu: bool = False
    link: Any = None                     # a pipeline stage's StageLink, None in one process
    handles: list = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.backend.compute_device

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.backend.compute_dtype

    # --- memory of the current block ---

    def alloc(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype, random: bool = False) -> Tensor:
        """A tensor homed on a tier, charged to that tier's accounting; disk gives a writable memmap view (random:
        mapped for reads of scattered pages, without the kernel's read-around)."""
        if kind not in self.tiers:
            raise ConfigError("the placement puts tensors on disk: pass an --offload-dir")
        tier = self.tiers[kind]
        handle = tier.allocate(shape, dtype)
        self.handles.append(handle)
        return tier.torch_view(handle, random=random) if kind == "disk" else handle.payload

    def mark(self) -> int:
        """A point to free back to (free_since): a join pass's transient activation homes."""
        return len(self.handles)

    def free_since(self, mark: int) -> None:
        for handle in self.handles[mark:]:
            handle.free()
        del self.handles[mark:]

    def release(self) -> None:
        """Free every tensor of the current block (disk files are deleted) once no queued copy can touch it."""
        self.backend.synchronize()
        self.free_since(0)
        if self.kv_staging is not None:
            self.kv_staging.clear()

    def async_lanes(self) -> frozenset:
        """Lanes worth a worker thread: on CUDA every copy is a DMA that runs beside the kernels. On a CPU a
        RAM-to-RAM copy or conversion is compute too, and a second thread only takes cores from the layer math
        (docs/architecture.md, "Overlap on a CPU"), so a lane gets a thread only where its reads wait on the disk."""
        if self.backend.is_cuda:
            return frozenset({"weights", "kv"})
        return frozenset(lane for lane, what in (("weights", "weights"), ("kv", "cache"))
                         if self.offload.tier_fractions(what)[2] > 0)

    # --- allocation ---

    def make_cache(self, layer: Any, plan: BatchPlan, budget: RowBudgets, capacity: int, policy: Any,
                   draws: KeyedDraws | None, rolling: bool, pages: PageRule | None = None) -> SplitKVCache:
        """One GPU batch's cache of one layer: every tier's part allocates the block's capacity (its largest
        sequence budget, as the planner counts it) and keeps its own rows' budgets. pages: what a step reads of a
        cache that keeps every token (kv/pages.py), None for the whole cache."""
        parts = []
        host_attention = (self.offload.cpu_cache_compute and any(kind != "compute" for _, _, kind in plan.cache)
                          and (self.device.type != "cpu" or self.host_attention_on_cpu))
        attention_on = "cpu" if host_attention else self.device.type
        # batch invariance: attention reads the stored rows wherever they were staged from (KVCache.copy_stored)
        reads = dict(read_in_place=self.offload.kv_read_in_place(attention_on, rolling, plan.size),
                     copy_stored=self.kernels.batch_invariant and attention_on == "cpu" and not rolling)
        if pages is not None:            # the pages a step reads are chosen where it computes
            reads["summaries"] = dict(summary_device=self.device, summary_dtype=self.compute_dtype)
        for lo, hi, kind in plan.cache:
            cache = kv_cache(layer.kv_spec(), hi - lo, capacity, policy, budget.part(lo, hi), fmt=self.offload.kv_format,
                            alloc=lambda shape, dtype, kind=kind: self.alloc(kind, shape, dtype, random=pages is not None),
                            tier_kind=kind, rolling=rolling, generator=None if draws is None else draws.part(lo, hi),
                            staging=self.kv_staging, kernels=self.kernels, pages=pages, **reads)
            parts.append((lo, hi, cache))
        return SplitKVCache(parts, attention_device=torch.device("cpu") if host_attention else None)

    def allocate(self, plan: Plan, ids: Tensor, valid: Tensor, draws: DrawsFor, *,
                 evicts: Sequence[bool] | None = None, refill: bool = False) -> list[BatchState]:
        """The block's GPU batches with their caches and activation homes, after the previous block's tensors are
        freed. ids, valid: (rows, length) left-padded prompts (a refilled block: placeholders of length 1).
        evicts: whether each row's budget evicts (None: score every row). refill: rows take prompts later."""
        self.release()                 # the previous block's KV goes before this block's is allocated
        # the transient tensors of one layer forward are real memory too: charge the compute tier an estimate
        self.handles.append(self.tiers["compute"].reserve(plan.layer_workspace(), "workspace (estimated)"))
        if "disk" in self.tiers:       # before the first file: enough room for this block?
            check_space(self.offload_root, plan.disk_bytes())
        policy, rolling = get_policy(plan.policy), plan.eviction.position_rolling
        mine = range(*self.stage)
        attention = [(l, layer) for l, layer in enumerate(self.layers) if layer.kind == "attn"]
        pages = plan.eviction.pages              # page selection: the first dense_layers read every page
        dense = 0 if pages is None else pages.dense_layers
        batches = []
        for bp in plan.batches:
            lo, hi = bp.lo, bp.hi
            rows = plan.budgets.part(lo, hi)
            b = BatchState(list(range(lo, hi)), ids[lo:hi], valid[lo:hi], real_len=valid[lo:hi].sum(1),
                           kept_max=torch.tensor(rows.values("budget")),
                           evicts=None if evicts is None else tuple(evicts[lo:hi]),
                           first_step=torch.zeros(hi - lo, dtype=torch.long) if refill else None)
            b.caches = {l: self.make_cache(layer, bp, rows, plan.capacity, policy, draws(l, lo, hi), rolling,
                                           pages if n >= dense else None)
                        for n, (l, layer) in enumerate(attention) if l in mine}
            b.activations = ActivationHome(list(bp.act), self.alloc, self.device)
            batches.append(b)
        return batches

    # --- running ---

    def run(self, plan: Plan, batches: list[BatchState], n_tokens: int, *,
            on_logits: Callable[[int, int, Tensor], None], should_stop: Callable[[int], bool],
            on_ids: Callable[[int, int, Tensor], None] | None = None, first_token: int = 0) -> list[float]:
        """Token steps [first_token, n_tokens) of `batches` through the zig-zag schedule; the wall time at the end
        of each. on_logits(token, batch, logits) samples where the head is; on a pipeline stage without it,
        on_ids(token, batch, ids) takes the ids the last stage sampled, so every stage tracks the same stops."""
        link = self.link
        parts = RunParts(backend=self.backend, layers=self.layers, groups=self.groups, weights=self.weights,
                         device=self.device, compute_dtype=self.compute_dtype, needs_scores=plan.needs_scores,
                         rolling=plan.eviction.position_rolling, score_reduce=plan.eviction.score_reduce,
                         prefill_rows=plan.prefill_rows, async_lanes=self.async_lanes(),
                         prefill_by_rows=plan.prefill_by_rows and link is None, kernels=self.kernels,
                         on_logits=on_logits, link=link, should_stop=should_stop,
                         score_window=plan.eviction.score_window)
        batch_major = False
        if link is not None:
            if not link.last:          # the ids arrive from the last stage; then this stage decides as it does
                def told(token: int) -> bool:
                    for k, ids in enumerate(link.recv_ids(batches)):
                        on_ids(token, k, ids)
                    return should_stop(token)
                parts.should_stop = told
            # a stage with every weight resident may take each batch through its layers in turn, so the next stage
            # starts on the first batch while this one computes the rest (frontends/scale_out.attach_link)
            batch_major = link.batch_major and self.offload.tier_fractions("weights")[0] == 1
        times = BlockExecutor(parts, batches, n_tokens, self.offload.overlap, first_token=first_token,
                              batch_major=batch_major).run()
        if link is not None:           # the block's tensors may be freed once its sends are done
            link.flush()
        return times
