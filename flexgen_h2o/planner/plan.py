"""One block's plan, worked out once: what the engine allocates and what the planner adds up.

A Plan is built from (model, placement, eviction rule, the block's prompt and generation lengths, device) and
holds every decision that follows from them: each sequence's KV budget and the rule that runs (the configured
one, or `full` when the budget holds the whole run), the GPU batches with each one's split of KV and resting
activations across tiers, the prefill chunking, the scored-attention block, the layer workspace, and the bytes
per tier. planner/job.py builds one per block of a job; the engine allocates from it (schedule/block.py);
`estimate` and `preflight` add it up; the CLI prints it. Weights are placed once per engine, not per block: both
the engine's placement and the planner's count take their homes from `weights.placement.weight_homes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from flexgen_h2o.config import OffloadPolicy, split_by_fraction
from flexgen_h2o.formats import StorageFormat
from flexgen_h2o.kv import EvictionConfig, RowBudgets, get_policy, policy_for
from flexgen_h2o.models import KVSpec, ModelConfig, StepContext, ops

Split = tuple[tuple[int, int, str], ...]          # (first row, end row, tier) ranges of one GPU batch


@dataclass(frozen=True)
class BatchPlan:
    lo: int                      # the batch's rows in the block
    hi: int
    cache: Split                 # its sequences' KV by tier (rows relative to the batch)
    act: Split                   # its resting hidden states by tier

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Plan:
    model: ModelConfig
    offload: OffloadPolicy
    eviction: EvictionConfig
    device_type: str             # "cpu" or "cuda": the compute device
    compute_itemsize: int        # 4 (fp32, a CPU) or 2 (fp16, CUDA)
    budgets: RowBudgets          # one per sequence, in row order
    policy: str                  # the rule that runs (kv.policy_for), `full` when nothing would be evicted
    prompt_len: int              # the block's padded prompt length (its longest prompt)
    gen_len: int                 # the block's largest number of new tokens
    batches: tuple[BatchPlan, ...]
    prefill_rows: int            # sequences of a GPU batch that go through a layer together at prefill
    score_block: int             # bytes of one scored-attention block at prefill (0: the rule needs no scores)

    @classmethod
    def for_block(cls, model: ModelConfig, offload: OffloadPolicy, eviction: EvictionConfig, budgets: RowBudgets,
                  prompt_lens: Sequence[int], gen_lens: Sequence[int], *, device_type: str, compute_itemsize: int,
                  keep_all: bool = False) -> "Plan":
        """The plan of one block of real prompts with their budgets (planner/job.plan_job resolves them). keep_all:
        the rule runs even where nothing is evicted (a prefill kept for later rules)."""
        return cls._build(model, offload.validate(), eviction, budgets, max(prompt_lens), max(gen_lens), device_type,
                          compute_itemsize, keep_all)

    @classmethod
    def for_shape(cls, model: ModelConfig, offload: OffloadPolicy, eviction: EvictionConfig, *, prompt_len: int,
                  gen_len: int, n_seqs: int | None = None, device_type: str, compute_itemsize: int) -> "Plan":
        """The planner's worst case before the prompts are known: `n_seqs` (default a full block) prompts all
        `prompt_len` long, each generating `gen_len`."""
        offload = offload.validate()
        n = min(n_seqs or offload.block_size, offload.block_size)
        budgets = RowBudgets.uniform(eviction.resolve(prompt_len, gen_len), n)
        return cls._build(model, offload, eviction, budgets, prompt_len, gen_len, device_type, compute_itemsize,
                          keep_all=False)

    @classmethod
    def for_refill(cls, model: ModelConfig, offload: OffloadPolicy, eviction: EvictionConfig, every: RowBudgets,
                   prompt_lens: Sequence[int], gen_lens: Sequence[int], *, device_type: str,
                   compute_itemsize: int) -> "Plan":
        """The plan of a continuously refilled job: one block of min(block size, prompts) rows that every prompt
        passes through, each row sized for the job's widest budget (any prompt may take any row), the prompt
        workspace for its longest prompt, and the rule from every prompt's own budget (`every`, each as if it
        ran alone). Rows start with the widest budget; a row takes its prompt's own when the prompt joins
        (KVCache.reset_row)."""
        widest = max(every.rows, key=lambda b: b.capacity)
        rows = min(offload.validate().block_size, len(prompt_lens))
        return cls._build(model, offload.validate(), eviction, RowBudgets.uniform(widest, rows), max(prompt_lens),
                          max(gen_lens), device_type, compute_itemsize, False, rule=policy_for(eviction, every).name)

    @classmethod
    def _build(cls, model: ModelConfig, offload: OffloadPolicy, eviction: EvictionConfig, budgets: RowBudgets,
               prompt_len: int, gen_len: int, device_type: str, itemsize: int, keep_all: bool,
               rule: str | None = None) -> "Plan":
        n, gbs = len(budgets), offload.gpu_batch_size
        batches = tuple(BatchPlan(lo, min(n, lo + gbs),
                                  tuple(split_by_fraction(min(n, lo + gbs) - lo, offload.tier_fractions("cache"))),
                                  tuple(split_by_fraction(min(n, lo + gbs) - lo, offload.tier_fractions("act"))))
                        for lo in range(0, n, gbs))
        policy = rule or (eviction.policy if keep_all else policy_for(eviction, budgets).name)
        rows = offload.prefill_rows(min(gbs, n), prompt_len, device_type)
        score_block = (ops.score_block_bytes(rows, model.n_heads, prompt_len, StepContext.query_chunk, device_type)
                       if get_policy(policy).needs_scores else 0)
        return cls(model, offload, eviction, device_type, itemsize, budgets, policy, prompt_len, gen_len, batches,
                   rows, score_block)

    # --- what follows from it ---

    @property
    def n_seqs(self) -> int:
        return len(self.budgets)

    @property
    def capacity(self) -> int:
        """Slots every sequence's cache allocates (the block's largest budget + 1, capped by its length); under page
        selection, whole pages, so that every page of every column starts on a page boundary of its tier."""
        pages = self.eviction.pages
        if pages is None:
            return self.budgets.capacity
        return -(-self.budgets.capacity // pages.page_size) * pages.page_size

    @property
    def needs_scores(self) -> bool:
        return get_policy(self.policy).needs_scores

    @property
    def kv_format(self) -> StorageFormat:
        return self.offload.kv_format

    @property
    def uses_disk(self) -> bool:
        """Whether KV or resting activations have files in the offload folder."""
        return self.offload.uses_disk

    @property
    def prefill_by_rows(self) -> bool:
        return self.offload.prefill_by_rows(self.device_type)

    def slot_bytes(self) -> int:
        """One slot of one sequence in one attention layer: K + V in the KV format, fp32 score, int32 position."""
        return KVSpec(self.model.n_kv_heads, self.model.head_dim).row_bytes(self.kv_format)

    def layer_workspace(self) -> int:
        """The transients of one layer forward at prefill (the largest phase of one GPU batch's prompt pass)."""
        return self.model.workspace_bytes(self.prefill_rows, self.prompt_len, self.compute_itemsize,
                                          self.score_block)

    def kv_bytes(self) -> dict[str, int]:
        """KV bytes per tier of the block's caches (one per attention layer and GPU batch)."""
        out: dict[str, int] = {}
        for b in self.batches:
            for lo, hi, tier in b.cache:
                out[tier] = out.get(tier, 0) + self.model.n_layers * (hi - lo) * self.capacity * self.slot_bytes()
        return out

    def activation_bytes(self) -> dict[str, int]:
        """Resting hidden states per tier (off-compute parts keep a prefill buffer unless prefilled by rows, and a
        decode buffer), plus each batch's fp32 step-0 logits on the compute tier."""
        out: dict[str, int] = {"compute": 0}
        m, c = self.model.hidden_size, self.compute_itemsize
        for b in self.batches:
            out["compute"] += b.size * self.model.vocab_size * 4
            for lo, hi, tier in b.act:
                rows = 1 if self.prefill_by_rows else self.prompt_len if tier == "compute" else self.prompt_len + 1
                out[tier] = out.get(tier, 0) + (hi - lo) * rows * m * c
        return out

    def describe(self) -> str:
        """One line for the startup output: GPU batches, KV slots and their bytes, prefill chunking."""
        sizes = sorted({b.size for b in self.batches}, reverse=True)
        chunk = "every layer per chunk" if self.prefill_by_rows else "layer by layer"
        kv = sum(self.kv_bytes().values())
        return (f"plan: {len(self.batches)} GPU batch(es) of {'/'.join(map(str, sizes))} | KV {self.capacity} "
                f"slots/seq x {self.model.n_layers} layers, {self.kv_format.name} ({self.slot_bytes()} B/token/layer), "
                f"{kv / 2**20:.1f} MiB | weights {self.offload.weight_format.name} | rule {self.policy} | prefill "
                f"{self.prefill_rows} seq/chunk, {chunk}")

    def disk_bytes(self) -> int:
        """Offload-file bytes the block allocates: its disk-homed KV slots and resting hidden states."""
        return self.kv_bytes().get("disk", 0) + self.activation_bytes().get("disk", 0)
