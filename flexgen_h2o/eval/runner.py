"""Runs a grid of points (policy x budget) over a list of items on the engine itself.

Two modes: `score_grid` teacher-forces a continuation (eviction active at every step) and returns each forced
token's negative log-likelihood and whether it was the argmax; `generate_grid` decodes greedily. One Engine
serves a whole task: its weights are placed once. Blocks of items run one after another, and every point of
the grid decodes a block from one shared prompt pass (Engine.prefill): on a CPU the prompts are most of the
cost, and the points would otherwise pay for the same prefill dozens of times. Each finished (point, block) can
be checkpointed, so a killed run resumes inside a task. kvpress's rows (eval/peers.py) run the same items and
blocks in kvpress's own pipeline, in a child process, and come back in the same shapes.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
from tqdm import tqdm

from flexgen_h2o.config import ConfigError, GenerationConfig, OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.eval.grid import GridPoint, is_peer
from flexgen_h2o.eval.peers import peer_grid
from flexgen_h2o.loader import LoadedModel

UNBOUNDED_WINDOW = 1 << 30


@dataclass
class Scored:
    """Per forced token of one item: -log p(token) and whether the model's argmax was that token."""
    nll: list[float] = field(default_factory=list)
    hit: list[bool] = field(default_factory=list)


@dataclass
class RunInfo:
    """What a grid point really ran with: slots per block (None = full), whether each block evicted, its own
    decode seconds, and the seconds of the prompt passes it shared with the other points of its grid."""
    slots: list[int | None] = field(default_factory=list)
    evicted: list[bool] = field(default_factory=list)
    seconds: float = 0.0
    shared_prefill_seconds: float = 0.0
    peer: dict | None = None          # a kvpress row: what ran it (system, press, parameters, versions)

    def add(self, block: dict) -> None:
        self.slots.append(block["slots"])
        self.evicted.append(block["evicted"])
        self.seconds += block["seconds"]
        self.shared_prefill_seconds += block.get("prefill_seconds", 0.0)
        self.peer = block.get("peer", self.peer)

    def as_dict(self) -> dict:
        real = [s for s in self.slots if s is not None]
        return {"slots_min": min(real) if real else None, "slots_max": max(real) if real else None,
                "blocks": len(self.slots), "blocks_evicting": sum(self.evicted), "seconds": round(self.seconds, 2),
                "shared_prefill_seconds": round(self.shared_prefill_seconds, 2),
                **({"peer": self.peer} if self.peer else {})}


class Checkpoint(Protocol):
    """Where a grid keeps each finished (point, block), so a killed run resumes inside a task (ResultStore)."""
    def get(self, key: str, block: int) -> dict | None: ...

    def put(self, key: str, block: int, value: dict) -> None: ...


class Runner:
    def __init__(self, model: LoadedModel, *, batch_size: int = 8, kv_dtype: str = "float16", seed: int = 0,
                 lift_window: bool = False, progress: bool = True, device: str | None = None,
                 kv_bits: int | None = None, weight_bits: int | None = None):
        """lift_window: let sequences run past the model's context window without position rolling (the
        streaming task's baselines; the engine refuses that otherwise). RoPE models only. kv_bits: a
        compressed KV cache (OffloadPolicy.kv_bits); weight_bits: compressed weight matrices."""
        cfg = model.config
        if lift_window:
            if cfg.positions != "rope":
                raise ConfigError(f"{cfg.name} has learned positions: it cannot run past its {cfg.max_seq_len}-token "
                                  "window at all, so the streaming task needs a RoPE (Llama-family) model")
            cfg = dataclasses.replace(cfg, max_seq_len=UNBOUNDED_WINDOW)
        self.model, self.seed, self.progress = model, seed, progress
        self.batch_size = batch_size
        offload = OffloadPolicy(gpu_batch_size=batch_size, num_gpu_batches=1, kv_dtype=kv_dtype, kv_bits=kv_bits,
                                weight_bits=weight_bits)
        tok = model.tokenizer
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
        self.decode = decode
        self.engine = Engine(cfg, model.read, offload=offload, locate=model.locate, device=device, decode=decode)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _blocks(self, n: int) -> list[range]:
        return [range(lo, min(n, lo + self.batch_size)) for lo in range(0, n, self.batch_size)]

    def _bar(self, total: int, desc: str):
        # disable=None: bars only on a terminal, so a nohup log keeps just the per-point lines
        return tqdm(total=total, desc=desc, unit="step", leave=False, disable=None if self.progress else True,
                    mininterval=2.0)

    def _grid(self, points: Sequence[GridPoint], prompts: Sequence[Sequence[int]], n_new: Callable[[range], int],
              run_block: Callable, checkpoint: Checkpoint | None, desc: str,
              peer_task: dict) -> dict[str, tuple[list, RunInfo]]:
        """Blocks outer, points inner: each block's prompts are prefilled once (Engine.prefill, once more for
        rolling points and for each score window) and every point decodes from that. Returns key -> (per-block
        results, RunInfo). kvpress rows run first, each in one child over the blocks (peer_task: peer_grid's gen
        or continuations)."""
        blocks = self._blocks(len(prompts))
        out = {p.key: ([None] * len(blocks), RunInfo()) for p in points}
        bar = self._bar(len(points) * sum(n_new(blk) for blk in blocks), desc)
        for point in [p for p in points if is_peer(p.policy)]:        # kvpress rows: their own process
            done = peer_grid(point, prompts, blocks, store=self.model.store_path, eos_id=self.model.config.eos_id,
                             decode=self.decode, checkpoint=checkpoint, on_block=bar.update, **peer_task)
            out[point.key][0][:] = [b["result"] for b in done]
            for b in done:
                out[point.key][1].add(b)
        points = [p for p in points if not is_peer(p.policy)]
        for bi, blk in enumerate(blocks):
            block_prompts = [list(prompts[i]) for i in blk]
            prompt_len, steps = max(map(len, block_prompts)), n_new(blk)
            shared: dict[tuple[bool, int | None], list] = {}
            for point in points:
                saved = checkpoint.get(point.key, bi) if checkpoint is not None else None
                if saved is None:
                    ev = point.eviction(prompt_len + steps, self.seed)
                    prefill_s = 0.0
                    # one prompt pass per (rolling, score window): a window's rules rank keys by its queries only
                    kept = (point.rolling, ev.score_window if ev.needs_scores else None)
                    if kept not in shared:
                        t0 = time.perf_counter()
                        shared[kept] = self.engine.prefill(block_prompts, rolling=kept[0], score_window=kept[1])
                        prefill_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    result = run_block(blk, block_prompts, ev, shared[kept], bar)
                    saved = {"result": result, "slots": point.slots(prompt_len + steps),
                             "evicted": ev.resolve(prompt_len, steps).evicts or (
                                 ev.pages is not None and ev.pages.skips(prompt_len + steps)), "prefill_seconds": prefill_s,
                             "seconds": time.perf_counter() - t0}
                    if checkpoint is not None:
                        checkpoint.put(point.key, bi, saved)
                else:
                    bar.update(steps)
                out[point.key][0][bi] = saved["result"]
                out[point.key][1].add(saved)
        bar.close()
        return out

    def score_grid(self, points: Sequence[GridPoint], prompts: Sequence[Sequence[int]],
                   continuations: Sequence[Sequence[int]], checkpoint: Checkpoint | None = None,
                   desc: str = "") -> dict[str, tuple[list[Scored], RunInfo]]:
        """Teacher-force each continuation after its prompt at every point; step t's logits are scored against
        cont[t]. Returns point key -> (per item Scored, RunInfo)."""
        if len(prompts) != len(continuations):
            raise ConfigError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        if any(len(c) == 0 for c in continuations):
            raise ConfigError("every continuation needs at least one token to score")

        def run_block(blk: range, block_prompts: list, ev, prefilled, bar) -> list[dict]:
            conts = [list(continuations[i]) for i in blk]
            rows = [{"nll": [], "hit": []} for _ in blk]

            def hook(step: int, seqs: list[int], logits: torch.Tensor) -> None:
                logp = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
                best = logp.argmax(dim=-1)
                for row, s in enumerate(seqs):
                    if step < len(conts[s]):
                        target = conts[s][step]
                        rows[s]["nll"].append(-float(logp[row, target]))
                        rows[s]["hit"].append(int(best[row]) == target)
                if seqs and seqs[0] == 0:
                    bar.update(1)

            self.engine.on_step_logits = hook
            try:
                self.engine.generate(block_prompts, GenerationConfig(max_new_tokens=max(map(len, conts)),
                                                                     stop_at_eos=False),
                                     max_new_tokens=[len(c) for c in conts], forced=conts, eviction=ev,
                                     prefilled=prefilled)
            finally:
                self.engine.on_step_logits = None
            return rows

        grid = self._grid(points, prompts, lambda blk: max(len(continuations[i]) for i in blk), run_block,
                          checkpoint, desc or "score", {"continuations": continuations})
        out = {}
        for key, (per_block, info) in grid.items():
            scored = [Scored(r["nll"], r["hit"]) for rows in per_block for r in rows]
            for i, (s, c) in enumerate(zip(scored, continuations)):
                if len(s.nll) != len(c):      # the engine must give one logits row per forced token
                    raise RuntimeError(f"item {i}: scored {len(s.nll)} of {len(c)} forced tokens")
            out[key] = (scored, info)
        return out

    def generate_grid(self, points: Sequence[GridPoint], prompts: Sequence[Sequence[int]], gen: GenerationConfig,
                      checkpoint: Checkpoint | None = None,
                      desc: str = "") -> dict[str, tuple[list[list[int]], list[str], RunInfo]]:
        """Greedy (or gen's sampling) generation at every point: key -> (token ids, texts (stop strings
        applied), RunInfo)."""
        def run_block(blk: range, block_prompts: list, ev, prefilled, bar) -> dict:
            def hook(step: int, seqs: list[int], logits: torch.Tensor) -> None:
                if seqs and seqs[0] == 0:
                    bar.update(1)

            self.engine.on_step_logits = hook
            try:
                r = self.engine.generate(block_prompts, gen, eviction=ev, prefilled=prefilled)
            finally:
                self.engine.on_step_logits = None
            return {"tokens": r.token_ids, "texts": r.texts}

        grid = self._grid(points, prompts, lambda blk: gen.max_new_tokens, run_block, checkpoint, desc or "generate",
                          {"gen": gen})
        return {key: ([t for r in per_block for t in r["tokens"]], [t for r in per_block for t in r["texts"]], info)
                for key, (per_block, info) in grid.items()}

    def score(self, point: GridPoint, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              desc: str = "") -> tuple[list[Scored], RunInfo]:
        """One point of score_grid."""
        return self.score_grid([point], prompts, continuations, desc=desc or point.key)[point.key]

    def generate(self, point: GridPoint, prompts: Sequence[Sequence[int]], gen: GenerationConfig,
                 desc: str = "") -> tuple[list[list[int]], list[str], RunInfo]:
        """One point of generate_grid."""
        return self.generate_grid([point], prompts, gen, desc=desc or point.key)[point.key]
