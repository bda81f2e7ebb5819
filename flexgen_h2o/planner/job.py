"""A job's plan, made once before anything runs and handed down.

plan_job checks every prompt against the model's context window and its KV budget, cuts the blocks (bucketed by
length, or in the given order), and builds each block's Plan from those budgets: the engine allocates from them,
the refilled run joins each prompt with its budget, and the preflight, the cost model and the report count
`peak`. Nothing downstream resolves a budget or checks a length again; a job whose block size changes (the
placement search) or that keeps a share of its prompts (data parallel) is planned again by `replan`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from flexgen_h2o.config import ConfigError, OffloadPolicy
from flexgen_h2o.kv import Budget, EvictionConfig, RowBudgets
from flexgen_h2o.models import ModelConfig
from flexgen_h2o.planner.plan import Plan

Label = Callable[[int], str]


def _prompt_label(i: int) -> str:
    return f"prompt {i}"


def check_context(max_seq_len: int, rolling: bool, lens: Sequence[int], max_new: Sequence[int],
                  label: Label, model_name: str = "the model") -> None:
    """Fail before any compute when a prompt is empty or its new tokens would run past the context window."""
    for i, (n, g) in enumerate(zip(lens, max_new)):
        if n == 0:
            raise ConfigError(f"{label(i)}: empty prompt (after tokenization): every prompt needs at least one token")
        if not rolling and n + g > max_seq_len:
            raise ConfigError(f"{label(i)}: prompt ({n} tokens) + max_new_tokens ({g}) exceed the context window "
                              f"({max_seq_len}) of {model_name}; shorten it, lower max_new_tokens, or use "
                              "--position-rolling (Llama)")


def check_budgets(eviction: EvictionConfig, groups: Sequence[Sequence[int]], lens: Sequence[int],
                  max_new: Sequence[int], label: Label) -> list[Budget]:
    """Each prompt's KV budget (kv.Budget), from its own length (h2o-port: its group's longest, the port's rule).
    A ratio budget of a short prompt can come to 0 slots: refuse it before any compute, naming it."""
    budgets: list[Budget | None] = [None] * len(lens)
    for block in groups:
        for group in ([list(block)] if eviction.per_block else [[i] for i in block]):
            try:
                rows = eviction.resolve_rows([lens[i] for i in group], [max_new[i] for i in group])
            except ValueError as e:
                raise ConfigError(f"{label(min(group, key=lambda i: lens[i]))}: {e}") from None
            for i, budget in zip(group, rows.rows):
                budgets[i] = budget
    return budgets  # type: ignore[return-value]


def plan_blocks(lens: Sequence[int], block_size: int, max_new: Sequence[int] | None = None, *,
                bucket: bool = True) -> list[list[int]]:
    """Indices cut into blocks of `block_size`. Bucketed: longest first (a run that cannot finish its largest
    block fails in its first minute), ties broken by max_new_tokens so a block stops together."""
    order = list(range(len(lens)))
    if bucket:
        order.sort(key=lambda i: (-lens[i], -(max_new[i] if max_new is not None else 0), i))
    return [order[i:i + block_size] for i in range(0, len(order), block_size)]


def padding_tokens(blocks: Sequence[Sequence[int]], lens: Sequence[int]) -> int:
    """Pad positions the engine computes: every prompt of a block is left-padded to the block's longest."""
    return sum(max(lens[i] for i in b) * len(b) - sum(lens[i] for i in b) for b in blocks if b)


@dataclass(frozen=True)
class JobPlan:
    """Every decision of one job. blocks: the caller's prompt indices per block, in run order (refill: one block
    of every prompt, in join order); budgets: each prompt's KV budget; plans: each block's Plan (refill: the
    refilled block's); peak: the largest block as the preflight, the cost model and the report count it."""
    model: ModelConfig
    offload: OffloadPolicy
    eviction: EvictionConfig
    device_type: str
    compute_itemsize: int
    lens: tuple[int, ...]
    max_new: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    budgets: tuple[Budget, ...]
    refill: bool
    bucket: bool
    check_window: bool
    keep_all: bool
    plans: tuple[Plan, ...]
    peak: Plan | None

    @property
    def n_prompts(self) -> int:
        return len(self.lens)

    def block_budgets(self, k: int) -> RowBudgets:
        return RowBudgets(tuple(self.budgets[i] for i in self.blocks[k]))

    def replan(self, *, offload: OffloadPolicy | None = None, keep: Sequence[int] | None = None,
               label: Label = _prompt_label) -> "JobPlan":
        """The same job with another placement (its block size may differ), or only the prompts `keep` names
        (renumbered 0.. in that order)."""
        keep = list(range(self.n_prompts)) if keep is None else list(keep)
        return plan_job(self.model, offload or self.offload, self.eviction, [self.lens[i] for i in keep],
                        [self.max_new[i] for i in keep], device_type=self.device_type,
                        compute_itemsize=self.compute_itemsize, label=label, bucket=self.bucket, refill=self.refill,
                        check_window=self.check_window, keep_all=self.keep_all)


def plan_job(model: ModelConfig, offload: OffloadPolicy, eviction: EvictionConfig, lens: Sequence[int],
             max_new: Sequence[int], *, device_type: str, compute_itemsize: int, label: Label = _prompt_label,
             bucket: bool = True, refill: bool = False, check_window: bool = True,
             keep_all: bool = False) -> JobPlan:
    """Check every prompt, resolve its budget, cut the blocks and plan each one.

    bucket: blocks of similar length (else in the given order). refill: one continuously refilled block
    (schedule/refill.py) where each prompt's budget is its own, as alone. check_window=False lets a run go past
    the context window without position rolling (the accuracy harness measures that collapse). keep_all: the
    rule runs even where nothing is evicted (a prompt pass kept for later rules, Engine.prefill)."""
    offload = offload.validate()
    if len(lens) != len(max_new):
        raise ConfigError(f"max_new_tokens has {len(max_new)} entries for {len(lens)} prompts")
    if check_window:
        check_context(model.max_seq_len, eviction.position_rolling, lens, max_new, label, model.name)
    else:
        check_context(model.max_seq_len, True, lens, max_new, label, model.name)     # empty prompts only
    if refill:
        blocks = [list(range(len(lens)))] if lens else []
        budgets = check_budgets(eviction, [[i] for i in range(len(lens))], lens, max_new, label)
    else:
        blocks = plan_blocks(lens, offload.block_size, max_new, bucket=bucket)
        budgets = check_budgets(eviction, blocks, lens, max_new, label)
    shape = dict(device_type=device_type, compute_itemsize=compute_itemsize)
    if refill:
        plans = (Plan.for_refill(model, offload, eviction, RowBudgets(tuple(budgets)), lens, max_new, **shape),
                 ) if lens else ()
    else:
        plans = tuple(Plan.for_block(model, offload, eviction, RowBudgets(tuple(budgets[i] for i in b)),
                                     [lens[i] for i in b], [max_new[i] for i in b], keep_all=keep_all, **shape)
                      for b in blocks)
    # the preflight's count: a full block of the longest prompt, each generating the most tokens
    peak = Plan.for_shape(model, offload, eviction, prompt_len=max(lens), gen_len=max(max_new),
                          n_seqs=min(offload.block_size, len(lens)), **shape) if lens else None
    return JobPlan(model, offload, eviction, device_type, compute_itemsize, tuple(lens), tuple(max_new),
                   tuple(tuple(b) for b in blocks), tuple(budgets), refill, bucket, check_window, keep_all, plans,
                   peak)

