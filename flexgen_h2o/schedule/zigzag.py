"""The zig-zag block schedule as data: a generator of Steps, in plain or overlapped order.

FlexGen's Algorithm 1. Legend of the paper's indices, used only in this file:
    i = token step (0 = prefill, then one per generated token)   -> Step.token
    j = layer in the flat list (embed, attn.0, mlp.0, ..., head) -> Step.layer
    k = GPU batch inside the block                                -> Step.batch
For one layer, every GPU batch of the block runs and reuses that layer's weights before the schedule moves on
to the next layer: weights cross the link once per layer per token for the whole block.

Overlapped order, per (i, j, k):
    LOAD_WEIGHT(i, j+1)   only at k == 0: the next layer's weights stream in during this whole layer
    LOAD_KV(i, j, k+1)    the next batch's KV
    LOAD_HIDDEN(i, j, k)  not prefetched: with one batch, batch 0's next ids are sampled by the step just
                          before (FlexGen needs a separate single-batch loop for this); hidden states are small
    COMPUTE(i, j, k)
    STORE_KV(i, j, k-1)   the previous batch's KV goes home while this batch computes
    STORE_HIDDEN(i, j, k)
    SYNC(i, j, k)
Neighbours that fall off an edge wrap the FlexGen way (k+1 past the last batch is batch 0 of layer j+1; j+1 past
the last layer is layer 0 of token i+1); steps past the last token are dropped. Imports nothing from the package.

A pipeline stage whose weights are resident uses a third order (_batch_major): each GPU batch through all of the
stage's layers in turn, so a batch leaves for the next stage while this stage computes the next one.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterator


class Op(Enum):
    LOAD_WEIGHT = "load_weight"     # stage layer `layer`'s weights on the compute device
    FREE_WEIGHT = "free_weight"     # drop the staged copy after the last batch used it
    LOAD_KV = "load_kv"             # stage (layer, batch)'s cache window
    LOAD_HIDDEN = "load_hidden"     # bring (batch)'s hidden state (or token ids) to the compute device
    COMPUTE = "compute"
    STORE_KV = "store_kv"           # commit (layer, batch)'s new rows / evictions to the cache's home
    STORE_HIDDEN = "store_hidden"   # send the output home (after the head: sample the next ids)
    SYNC = "sync"                   # wait for every transfer issued so far


@dataclass(frozen=True)
class Step:
    op: Op
    token: int      # 0 = prefill, then one per generated token
    layer: int      # index in the flat layer list
    batch: int      # GPU batch inside the block (-1 for per-layer ops)


def _plain(start: int, n_tokens: int, n_layers: int, n_batches: int) -> Iterator[Step]:
    for i in range(start, n_tokens):
        for j in range(n_layers):
            yield Step(Op.LOAD_WEIGHT, i, j, -1)
            for k in range(n_batches):
                for op in (Op.LOAD_KV, Op.LOAD_HIDDEN, Op.COMPUTE, Op.STORE_KV, Op.STORE_HIDDEN):
                    yield Step(op, i, j, k)
            yield Step(Op.FREE_WEIGHT, i, j, -1)


def _overlapped(start: int, n_tokens: int, n_layers: int, n_batches: int) -> Iterator[Step]:
    def shift(i: int, j: int, k: int, dk: int) -> tuple[int, int, int] | None:
        k += dk
        if k >= n_batches:
            k, j = 0, j + 1
        elif k < 0:
            k, j = n_batches - 1, j - 1
        if j >= n_layers:
            j, i = 0, i + 1
        elif j < 0:
            j, i = n_layers - 1, i - 1
        return (i, j, k) if start <= i < n_tokens else None

    yield Step(Op.LOAD_WEIGHT, start, 0, -1)
    yield Step(Op.LOAD_KV, start, 0, 0)
    yield Step(Op.SYNC, start, 0, 0)
    for i in range(start, n_tokens):
        for j in range(n_layers):
            for k in range(n_batches):
                if k == 0:
                    nxt_layer = shift(i, j, n_batches - 1, 1)     # first batch of the next layer
                    if nxt_layer is not None:
                        yield Step(Op.LOAD_WEIGHT, nxt_layer[0], nxt_layer[1], -1)
                nxt = shift(i, j, k, 1)
                if nxt is not None:
                    yield Step(Op.LOAD_KV, *nxt)
                yield Step(Op.LOAD_HIDDEN, i, j, k)
                yield Step(Op.COMPUTE, i, j, k)
                prev = shift(i, j, k, -1)
                if prev is not None:
                    yield Step(Op.STORE_KV, *prev)
                yield Step(Op.STORE_HIDDEN, i, j, k)
                if k == n_batches - 1:
                    yield Step(Op.FREE_WEIGHT, i, j, -1)
                yield Step(Op.SYNC, i, j, k)
    yield Step(Op.STORE_KV, n_tokens - 1, n_layers - 1, n_batches - 1)
    yield Step(Op.SYNC, n_tokens - 1, n_layers - 1, n_batches - 1)


def _batch_major(start: int, n_tokens: int, n_layers: int, n_batches: int) -> Iterator[Step]:
    """Each GPU batch through every layer before the next batch starts: for a pipeline stage whose weights are
    resident (staging them again per batch costs nothing), so its first batch leaves for the next stage while
    this stage computes the others, and the stages compute at once."""
    for i in range(start, n_tokens):
        for k in range(n_batches):
            for j in range(n_layers):
                yield Step(Op.LOAD_WEIGHT, i, j, -1)
                for op in (Op.LOAD_KV, Op.LOAD_HIDDEN, Op.COMPUTE, Op.STORE_KV, Op.STORE_HIDDEN):
                    yield Step(op, i, j, k)
                yield Step(Op.FREE_WEIGHT, i, j, -1)


def block_schedule(n_tokens: int, n_layers: int, n_batches: int, *, overlap: bool,
                   batch_major: bool = False, start: int = 0) -> Iterator[Step]:
    """Every step of token steps [start, n_tokens) of one block, in execution order (batch_major:
    _batch_major's order, never overlapped)."""
    if min(n_tokens - start, n_layers, n_batches) < 1 or start < 0:
        raise ValueError("n_tokens - start, n_layers and n_batches must be >= 1, start >= 0")
    if batch_major:
        return _batch_major(start, n_tokens, n_layers, n_batches)
    return (_overlapped if overlap else _plain)(start, n_tokens, n_layers, n_batches)
