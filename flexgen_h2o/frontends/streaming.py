"""A scripted conversation stream for Engine.generate(forced=...): user turns are fed, replies are generated.

One sequence, one fixed cache: the engine asks for entry t at step t and reports step t's logits right after,
so the script decides what comes next (the rest of a turn, SAMPLE, or END) from what the model just said.
scripts/streaming_demo.py runs it on SmolLM2 past the context window with position rolling.
"""
from __future__ import annotations

from typing import Sequence

import torch

from flexgen_h2o.engine import END, SAMPLE


class ConversationScript(Sequence[int]):
    """The `forced` list of one sequence, written as the stream goes: user turns are forced, replies sampled.

    Entry t is asked for at step t; observe(t, logits) then tells what step t produced. Greedy decoding, so the
    token the engine fed back at a sampled step is argmax(logits)."""

    def __init__(self, turns: list[list[int]], end_of_turn: list[int], max_reply: int, stop_ids: set[int]):
        self.turns, self.end_of_turn, self.max_reply, self.stop_ids = turns, end_of_turn, max_reply, stop_ids
        self.queue: list[int] = list(turns[0])     # forced tokens still to feed
        self.turn = 0                               # index of the turn being fed or answered
        self.replies: list[list[int]] = [[] for _ in turns]
        self.nll: list[list[float]] = [[] for _ in turns]
        self.answering = False
        self._next = 0
        self._entry = SAMPLE                       # what step _next - 1 was told

    def prompt(self) -> list[int]:
        """The first turn, to prefill: the model answers it from step 0 on."""
        self.queue, self.answering = [], True
        return list(self.turns[0])

    def __len__(self) -> int:
        return 1 << 40                              # the script decides when to END

    def __getitem__(self, t: int) -> int:
        if t != self._next:
            raise IndexError(f"the stream is read in order: asked for step {t}, expected {self._next}")
        self._next += 1
        self._entry = self.queue.pop(0) if self.queue else (SAMPLE if self.answering else END)
        return self._entry

    def observe(self, t: int, logits: torch.Tensor) -> None:
        """Step t's logits (called right after entry t was read)."""
        if self._entry == END:
            return
        fed = self._entry if self._entry >= 0 else int(logits.argmax())    # greedy: what the engine fed
        if not self.answering:
            self.nll[self.turn].append(float(-torch.log_softmax(logits.float(), -1)[fed]))
            if not self.queue:                      # the turn is in: the model answers from the next step on
                self.answering = True
            return
        self.replies[self.turn].append(fed)
        done = fed in self.stop_ids
        if done or len(self.replies[self.turn]) >= self.max_reply:
            self.answering = False
            self.turn += 1
            if self.turn < len(self.turns):
                # a reply cut at max_reply still gets its end-of-turn marker before the next user turn
                self.queue = ([] if done else list(self.end_of_turn)) + list(self.turns[self.turn])
