"""Next-token choice (greedy, temperature, top-k, top-p) and per-sequence stop tracking.

Sampling draws from one torch.Generator per sequence, seeded from (seed, sequence index), so a sequence's
samples do not depend on which batch or block it ran in.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from flexgen_h2o.config import GenerationConfig


class Sampler:
    def __init__(self, gen: GenerationConfig, seq_ids: Sequence[int]):
        self.gen = gen
        self.generators = [torch.Generator().manual_seed(gen.seed * 1_000_003 + i) for i in seq_ids]

    def __call__(self, logits: Tensor, rows: Sequence[int | None] | None = None) -> Tensor:
        """logits (b, V) on the compute device -> next ids (b,) long on the host; `rows` are the sequences'
        indices in this sampler, None for a row that holds no sequence (continuous refill's free rows: they take
        the argmax and draw nothing, so no sequence's generator moves). Greedy picks on the device, so only b
        ids cross to the host (a 1024-sequence batch's fp32 logits are 206 MB a step); sampling moves fp32
        logits to the host, where each sequence's generator lives."""
        if self.gen.greedy:
            return logits.argmax(dim=-1).cpu()
        if rows is not None and None in rows:
            picked = logits.argmax(dim=-1).cpu()
            live = [r for r, s in enumerate(rows) if s is not None]
            if live:
                picked[live] = self(logits[live], [rows[r] for r in live])
            return picked
        logits = logits.float().cpu() / self.gen.temperature
        if self.gen.top_k > 0:
            kth = torch.topk(logits, min(self.gen.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.gen.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            # drop a token once the mass before it already reaches top_p; the first token always stays
            drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= self.gen.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        gens = self.generators if rows is None else [self.generators[r] for r in rows]
        return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(gens)])


class StopTracker:
    """Which sequences are done, why, and how many generated tokens each keeps."""

    def __init__(self, n: int, gen: GenerationConfig, eos_id: int | None,
                 decode: Callable[[list[int]], str] | None, max_new: Sequence[int] | None = None):
        self.gen, self.eos_id, self.decode = gen, eos_id, decode
        self.max_new = list(max_new) if max_new is not None else [gen.max_new_tokens] * n
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n

    @property
    def all_done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def end(self, i: int) -> None:
        """Finish sequence i now (a scripted stream ran out), keeping the tokens so far."""
        if self.reasons[i] is None:
            self.reasons[i] = "length"

    def update(self, next_ids: Sequence[int], seqs: Sequence[int] | None = None) -> None:
        """Record each sequence's next id: next_ids[j] belongs to sequence seqs[j] (default: j)."""
        for i, tok in zip(range(len(next_ids)) if seqs is None else seqs, next_ids):
            if self.reasons[i] is not None:
                continue
            self.tokens[i].append(int(tok))
            if self.gen.stop_at_eos and self.eos_id is not None and tok == self.eos_id:
                self.reasons[i] = "eos"
            elif self.gen.stop and self.decode is not None and self._hit_stop(i):
                self.reasons[i] = "stop"
            elif len(self.tokens[i]) >= self.max_new[i]:
                self.reasons[i] = "length"

    def _hit_stop(self, i: int) -> bool:
        # decoded text, not tokens: a stop string may straddle token boundaries; it is cut from the text later
        text = self.decode(self.tokens[i])
        return any(s in text for s in self.gen.stop)

    def text(self, i: int) -> str:
        """Sequence i's text: stop string and what follows it cut, EOS dropped; i finishes ("length") if open."""
        if self.reasons[i] is None:
            self.reasons[i] = "length"
        toks = self.tokens[i]
        text = self.decode(toks) if self.decode else ""
        if self.reasons[i] == "stop":
            text = text[:min(text.find(s) for s in self.gen.stop if s in text)]
        elif self.reasons[i] == "eos" and self.decode:
            text = self.decode(toks[:-1])
        return text

    def finish(self) -> tuple[list[list[int]], list[str], list[str]]:
        """Token ids, texts (stop strings cut) and finish reasons."""
        texts = [self.text(i) for i in range(len(self.tokens))]
        return self.tokens, texts, [r or "length" for r in self.reasons]
