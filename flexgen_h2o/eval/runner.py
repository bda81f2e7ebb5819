"""Runs one grid point over a list of items on the engine itself, block by block.

Two modes: `score` teacher-forces a continuation (eviction active at every step) and returns each forced
token's negative log-likelihood and whether it was the argmax; `generate` decodes greedily. One Engine serves a
whole task: its weights are placed once and only its EvictionConfig changes between grid points.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from flexgen_h2o.config import ConfigError, GenerationConfig, OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.eval.grid import GridPoint
from flexgen_h2o.loader import LoadedModel

UNBOUNDED_WINDOW = 1 << 30


@dataclass
class Scored:
    """Per forced token of one item: -log p(token) and whether the model's argmax was that token."""
    nll: list[float] = field(default_factory=list)
    hit: list[bool] = field(default_factory=list)


@dataclass
class RunInfo:
    """What a grid point really ran with: slots per block (None = full) and whether each block evicted."""
    slots: list[int | None] = field(default_factory=list)
    evicted: list[bool] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        real = [s for s in self.slots if s is not None]
        return {"slots_min": min(real) if real else None, "slots_max": max(real) if real else None,
                "blocks": len(self.slots), "blocks_evicting": sum(self.evicted), "seconds": round(self.seconds, 2)}


class Runner:
    def __init__(self, model: LoadedModel, *, batch_size: int = 8, kv_dtype: str = "float16", seed: int = 0,
                 lift_window: bool = False, progress: bool = True, device: str | None = None):
        """lift_window: let sequences run past the model's context window without position rolling (the
        streaming task's baselines; the engine refuses that otherwise). RoPE models only."""
        cfg = model.config
        if lift_window:
            if cfg.positions != "rope":
                raise ConfigError(f"{cfg.name} has learned positions: it cannot run past its {cfg.max_seq_len}-token "
                                  "window at all, so the streaming task needs a RoPE (Llama-family) model")
            cfg = dataclasses.replace(cfg, max_seq_len=UNBOUNDED_WINDOW)
        self.model, self.seed, self.progress = model, seed, progress
        self.batch_size = batch_size
        offload = OffloadPolicy(gpu_batch_size=batch_size, num_gpu_batches=1, kv_dtype=kv_dtype)
        tok = model.tokenizer
        decode = (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
        self.engine = Engine(cfg, model.read, offload=offload, locate=model.locate, device=device, decode=decode)

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _blocks(self, n: int) -> list[range]:
        return [range(lo, min(n, lo + self.batch_size)) for lo in range(0, n, self.batch_size)]

    def _set_point(self, point: GridPoint, prompt_len: int, n_new: int, info: RunInfo) -> None:
        ev = point.eviction(prompt_len + n_new, self.seed)
        if ev.position_rolling and self.engine.model.positions != "rope":
            raise ConfigError("position rolling applies to RoPE models (Llama) only")
        # the engine reads its eviction config at every generate(); swapping it keeps the placed weights
        self.engine.eviction = ev
        info.slots.append(point.slots(prompt_len + n_new))
        info.evicted.append(ev.resolve(prompt_len, n_new).evicts)

    def _bar(self, total: int, desc: str):
        from tqdm import tqdm
        # disable=None: bars only on a terminal, so a nohup log keeps just the per-point lines
        return tqdm(total=total, desc=desc, unit="step", leave=False, disable=None if self.progress else True,
                    mininterval=2.0)

    def score(self, point: GridPoint, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              desc: str = "") -> tuple[list[Scored], RunInfo]:
        """Teacher-force each continuation after its prompt; step t's logits are scored against cont[t]."""
        if len(prompts) != len(continuations):
            raise ConfigError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        if any(len(c) == 0 for c in continuations):
            raise ConfigError("every continuation needs at least one token to score")
        out = [Scored() for _ in prompts]
        info = RunInfo()
        blocks = self._blocks(len(prompts))
        bar = self._bar(sum(max(len(continuations[i]) for i in blk) for blk in blocks), desc or point.key)
        t0 = time.perf_counter()
        for blk in blocks:
            conts = [list(continuations[i]) for i in blk]
            n_new = max(len(c) for c in conts)
            self._set_point(point, max(len(prompts[i]) for i in blk), n_new, info)

            def hook(step: int, seqs: list[int], logits: torch.Tensor, conts=conts, base=blk.start) -> None:
                logp = torch.log_softmax(logits.detach().float().cpu(), dim=-1)
                best = logp.argmax(dim=-1)
                for row, s in enumerate(seqs):
                    cont = conts[s]
                    if step < len(cont):
                        target = cont[step]
                        out[base + s].nll.append(-float(logp[row, target]))
                        out[base + s].hit.append(int(best[row]) == target)
                if seqs and seqs[0] == 0:
                    bar.update(1)

            self.engine.on_step_logits = hook
            try:
                self.engine.generate([list(prompts[i]) for i in blk],
                                     GenerationConfig(max_new_tokens=n_new, stop_at_eos=False),
                                     max_new_tokens=[len(c) for c in conts], forced=conts)
            finally:
                self.engine.on_step_logits = None
        bar.close()
        info.seconds = time.perf_counter() - t0
        for i, (s, c) in enumerate(zip(out, continuations)):
            if len(s.nll) != len(c):      # the engine must give one logits row per forced token
                raise RuntimeError(f"item {i}: scored {len(s.nll)} of {len(c)} forced tokens")
        return out, info

    def generate(self, point: GridPoint, prompts: Sequence[Sequence[int]], gen: GenerationConfig,
                 desc: str = "") -> tuple[list[list[int]], list[str], RunInfo]:
        """Greedy (or gen's sampling) generation; returns token ids, texts (stop strings applied), RunInfo."""
        tokens: list[list[int]] = []
        texts: list[str] = []
        info = RunInfo()
        blocks = self._blocks(len(prompts))
        bar = self._bar(len(blocks) * gen.max_new_tokens, desc or point.key)
        t0 = time.perf_counter()

        def hook(step: int, seqs: list[int], logits: torch.Tensor) -> None:
            if seqs and seqs[0] == 0:
                bar.update(1)

        self.engine.on_step_logits = hook
        try:
            for blk in blocks:
                self._set_point(point, max(len(prompts[i]) for i in blk), gen.max_new_tokens, info)
                r = self.engine.generate([list(prompts[i]) for i in blk], gen)
                tokens += r.token_ids
                texts += r.texts
        finally:
            self.engine.on_step_logits = None
        bar.close()
        info.seconds = time.perf_counter() - t0
        return tokens, texts, info
