"""Offline batches of many prompts: tokenizing, one engine call per block of a job (planner/job.py cuts and plans
them), progress bars.

Shared by the Python API (`flexgen_h2o.LLM`) and the CLI's batch mode, so both produce the same tokens for the
same prompts, seed and policies. The engine pads every block to its longest prompt and runs it to its largest
`max_new_tokens`; sorting by length puts prompts of similar length (and budget) in one block, which wastes little
padding. Results are handed back per block, in the caller's indices; restoring the input order is the caller's.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from tqdm import tqdm

from flexgen_h2o.config import ConfigError, GenerationConfig
from flexgen_h2o.planner.job import JobPlan


def encode_prompts(tokenizer: Any, prompts: Sequence[str | Sequence[Mapping[str, str]]], *,
                   chat: bool) -> list[list[int]]:
    """Token ids of prompts. A string is raw text, or with `chat` one user turn; a list of {"role", "content"}
    messages is a chat. Chats go through the tokenizer's chat template with the assistant turn opened."""
    if tokenizer is None:
        raise ConfigError("this model has no tokenizer in its store: convert a checkpoint that ships one (dummy "
                          "weights borrow SmolLM2's once `make run` has converted it), or give token ids")
    out = []
    for p in prompts:
        if isinstance(p, str) and not chat:
            out.append(list(tokenizer.encode(p)))
            continue
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("this tokenizer has no chat template; use plain prompts")
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else [dict(m) for m in p]
        out.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)))
    return out


class Progress:
    """tqdm bars for prefill (prompt tokens) and decode (generated tokens), with tokens/s, fed by the engine's
    per-step hook (one call per GPU batch and token step)."""

    def __init__(self, enabled: bool, prompt_tokens: int, new_tokens: int):
        kw = dict(unit="tok", unit_scale=True, dynamic_ncols=True, disable=not enabled, leave=True)
        self.prefill = tqdm(total=prompt_tokens, desc="prefill", position=0, **kw)
        self.decode = tqdm(total=new_tokens, desc="decode ", position=1, **kw)
        self._decoded = 0            # exact generated tokens of finished blocks

    def hook(self, lens: Sequence[int], max_new: Sequence[int]) -> Callable:
        def on_step(token: int, seqs: list[int], logits: Any) -> None:
            if token == 0:
                self.prefill.update(sum(lens[s] for s in seqs))
            # sequences still below their budget; ones stopped early are corrected when the block ends
            self.decode.update(sum(1 for s in seqs if token < max_new[s]))
        return on_step

    def block_done(self, generated: int, budgeted: int) -> None:
        self._decoded += generated
        self.decode.total -= budgeted - generated      # tokens never generated (eos / stop strings)
        self.decode.n = self._decoded
        self.decode.refresh()

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


class RefillProgress:
    """tqdm bars for a refilled job (schedule/refill.py): prompts finished, and tokens generated with tokens/s
    (its total the job's max_new_tokens, lowered as prompts stop early)."""

    def __init__(self, enabled: bool, n_prompts: int, new_tokens: int):
        kw = dict(dynamic_ncols=True, disable=not enabled, leave=True)
        self.prompts = tqdm(total=n_prompts, desc="prompts", unit="prompt", position=0, **kw)
        self.decode = tqdm(total=new_tokens, desc="decode ", unit="tok", unit_scale=True, position=1, **kw)

    def tokens(self, n: int) -> None:
        self.decode.update(n)

    def finished(self, generated: int, budgeted: int) -> None:
        """One prompt done after `generated` of its `budgeted` tokens."""
        self.prompts.update(1)
        self.decode.total -= budgeted - generated
        self.decode.refresh()

    def close(self) -> None:
        self.prompts.close()
        self.decode.close()


def run_refill(engine: Any, prompt_ids: Sequence[Sequence[int]], gen: GenerationConfig, job: JobPlan, *,
               progress: bool = False, seeds: Sequence[int] | None = None,
               share: float | None = None) -> Iterator[BlockResult]:
    """The job's prompts (job.blocks[0] names them, in join order) through one continuously refilled block
    (Engine.generate_refill); yields the prompts that finished together as one BlockResult (caller's indices),
    as soon as they are done. Its metrics are the job's, on the last result only."""
    order = list(job.blocks[0]) if job.blocks else []
    max_new = job.max_new
    bars = RefillProgress(progress, len(order), sum(max_new[i] for i in order))
    try:
        run = engine.generate_refill([prompt_ids[i] for i in order], gen, [max_new[i] for i in order],
                                     seeds=[seeds[i] if seeds is not None else i for i in order], share=share,
                                     on_tokens=bars.tokens, job=job)
        for done in run:
            for f in done:
                bars.finished(len(f.token_ids), max_new[order[f.index]])
            yield BlockResult([order[f.index] for f in done], [f.token_ids for f in done], [f.text for f in done],
                              [f.finish_reason for f in done], {})
    finally:
        bars.close()


def refill_totals(metrics: dict, lens: Sequence[int], order: Sequence[int]) -> Counter:
    """A refilled job's metrics in add_metrics' terms, plus its joins and how busy its rows were."""
    total: Counter = Counter({k: metrics[k] for k in ("prefill_s", "decode_s", "generated_tokens", "decode_steps")})
    total.update(padded_prompt_tokens=metrics["prompt_tokens"], prompt_tokens=sum(lens[i] for i in order),
                 blocks=1, joins=metrics["joins"])
    total["row_occupancy"] = metrics["busy_row_steps"] / max(1, metrics["row_steps"])
    return total


@dataclass
class BlockResult:
    indices: list[int]                   # caller's indices, in the order the block ran them
    token_ids: list[list[int]]
    texts: list[str]
    finish_reasons: list[str]
    metrics: dict


def run_blocks(engine: Any, prompt_ids: Sequence[Sequence[int]], gen: GenerationConfig, job: JobPlan, *,
               progress: bool = False, seeds: Sequence[int] | None = None) -> Iterator[BlockResult]:
    """Each block of `job` through Engine.generate_block with its plan; yields each block's results as soon as it
    is done. Each prompt samples from a generator seeded by seeds[i] (default: its index i here), wherever
    bucketing puts it."""
    lens, max_new = job.lens, job.max_new
    bars = Progress(progress, sum(lens[i] for b in job.blocks for i in b),
                    sum(max_new[i] for b in job.blocks for i in b))
    previous = engine.on_step_logits
    hook = bars.hook(lens, max_new)                  # the engine reports the job's (caller's) indices
    if previous is None:
        engine.on_step_logits = hook
    else:          # keep a hook someone else set (tests record logits through it)
        engine.on_step_logits = lambda t, s, l: (hook(t, s, l), previous(t, s, l))
    try:
        for k, block in enumerate(job.blocks):
            block = list(block)
            tokens, texts, reasons, metrics = engine.generate_block(
                job, k, [prompt_ids[i] for i in block], gen, [seeds[i] if seeds is not None else i for i in block])
            bars.block_done(sum(len(t) for t in tokens), sum(max_new[i] for i in block))
            yield BlockResult(block, tokens, texts, reasons, metrics)
    finally:
        engine.on_step_logits = previous
        bars.close()


def add_metrics(total: Counter, res: BlockResult, lens: Sequence[int]) -> None:
    """Accumulate a block's times and token counts; prompt tokens are counted real and padded."""
    m = res.metrics
    for k in ("prefill_s", "decode_s", "generated_tokens", "decode_steps"):
        total[k] += m.get(k, 0)
    total["padded_prompt_tokens"] += m.get("prompt_tokens", 0)      # the engine counts block x padded length
    total["prompt_tokens"] += sum(lens[i] for i in res.indices)
    total["blocks"] += 1
