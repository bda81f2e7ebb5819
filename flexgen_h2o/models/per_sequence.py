"""A left-padded prompt batch attended sequence by sequence, each on its own tokens: how batch-invariant kernels
run a prompt (TorchKernels.prompt_attention in models/ops.py; the table in kernels/dispatch.py)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flexgen_h2o.models.layer import StepContext


def per_sequence_attention(attend: Callable, q: Tensor, k: Tensor, v: Tensor, ctx: "StepContext",
                           scale: float) -> tuple[Tensor, Tensor | None]:
    """`attend` once per sequence of a left-padded prompt batch, on that sequence's own tokens, so that each call
    has the shapes and data it has when the prompt runs alone: a sequence's output and key mass then do not
    depend on its batch-mates, its row or the padding (docs/cli.md, "What is guaranteed"). A sequence whose own
    budget keeps its whole run (ctx.score_rows) is attended as the full cache attends, as it is alone, and gets no
    mass (it never chooses a victim). Pads get zeros. A score window (ctx.score_window) counts the last rows of
    the sequence's own tokens: the same queries as the last rows of its left-padded row."""
    out = q.new_zeros(q.shape)
    scores = q.new_zeros(k.shape[:3], dtype=torch.float32) if ctx.want_scores else None
    for i, pad in enumerate(ctx.pad_counts):
        one = ctx.rows(i, i + 1)
        scored = ctx.want_scores and (ctx.score_rows is None or ctx.score_rows[i])
        one = dataclasses.replace(one, positions=one.positions[:, pad:], token_valid=one.token_valid[:, pad:],
                                  unpadded=True, pad_counts=(0,), want_scores=scored, score_rows=None)
        o, sc = attend(q[i:i + 1, :, pad:], k[i:i + 1, :, pad:], v[i:i + 1, :, pad:], one, scale)
        out[i, :, pad:] = o[0]
        if scored:
            scores[i, :, pad:] = sc[0]
    return out, scores
