"""A pipeline of layer stages across torchrun's ranks (FlexGen's dist_flex_opt.py, on torch.distributed).

Rank s holds a contiguous run of schedule layers (split_layers) with its own placement and runs the zig-zag
schedule over them: for each token step, layer by layer, every GPU batch of the block. A GPU batch's hidden
state leaves the stage's last layer with a non-blocking send, so the stage goes on with its next batch while
the state travels, and the next stage starts that batch's first layer as soon as it arrives. The last stage
holds the LM head: it samples and sends each batch's next ids to every other stage, which feeds them to its
own stop rules (and, on the first stage, to the embedding), so every stage decides the same stops and the same
refill joins without another message. H2O caches live with their attention layers, so no KV ever crosses a link.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from flexgen_h2o.formats import WEIGHT_FORMAT
from flexgen_h2o.models import build_layers, schedule_groups
from flexgen_h2o.planner.cost import decode_layer_s, layer_costs

TAG_HIDDEN, TAG_IDS = 11, 12


def split_work(work: Sequence[float], n_stages: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) runs of `work` items, one per stage, each non-empty, minimising the largest sum."""
    n = len(work)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} schedule layers into {n_stages} stages")
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: the smallest possible largest stage over the first i items in s stages; cut[s][i]: where it starts
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [], n
    for s in range(n_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def split_layers(cfg: Any, n_stages: int, sep_layer: bool, rates: dict | None = None,
                 rows: int = 1) -> list[tuple[int, int]]:
    """Each stage's [lo, hi) range of flat layer indices (embed, attn.0, mlp.0, ..., head), cut between schedule
    layers. With this machine's rates (calibrate.py), balanced by the cost model's decode time of each schedule
    layer for a GPU batch of `rows` (planner/cost.decode_layer_s: the model's own block timing, the head's matrix
    at the measured rate, a fixed cost per layer call); without them, by matrix FLOPs per token: a stage's compute,
    and on a GPU that streams fp16 weights the bytes its link carries (the same number). An embedding table is a
    row lookup: no FLOPs; the LM head weighs its whole vocabulary matrix."""
    layers = build_layers(cfg)
    groups = schedule_groups([layer.kind for layer in layers], sep_layer)
    work = (decode_layer_s(cfg, rates, rows, sep_layer) if rates is not None
            else [g.flops_per_row for g in layer_costs(cfg, (1.0, 0.0, 0.0), WEIGHT_FORMAT, sep_layer)])
    return [(groups[a][0], groups[b - 1][-1] + 1) for a, b in split_work(work, n_stages)]


@dataclass
class StageLink:
    """One stage's sends and receives. Hidden states go to the next stage, sampled ids from the last stage to
    every other; every message between two ranks comes in the order sent."""
    stage: int
    n_stages: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    group: Any = None              # NCCL between GPUs; None: the default (gloo) group
    batch_major: bool = False      # with resident weights, each GPU batch through the stage's layers in turn

    def __post_init__(self) -> None:
        self.first, self.last = self.stage == 0, self.stage == self.n_stages - 1
        self._sending: list = []   # (work, tensor): a tensor stays alive until its send completed

    def _isend(self, t: Tensor, dst: int, tag: int) -> None:
        t = t.contiguous()
        self._sending.append((dist.isend(t, dst, group=self.group, tag=tag), t))
        if len(self._sending) > 64:            # bound what is held: the oldest are long done
            self._sending.pop(0)[0].wait()

    def _recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, src, group=self.group, tag=tag)
        return t

    def send_hidden(self, x: Tensor) -> None:
        self._isend(x.to(self.dtype, copy=True), self.stage + 1, TAG_HIDDEN)   # x may be a reused buffer

    def recv_hidden(self, rows: int, length: int) -> Tensor:
        return self._recv((rows, length, self.hidden_size), self.dtype, self.stage - 1, TAG_HIDDEN)

    def send_ids(self, ids: Tensor) -> None:
        """Last stage: a GPU batch's sampled ids, to every other stage."""
        msg = ids.view(-1).to(torch.long)
        for stage in range(self.n_stages - 1):
            self._isend(msg.to(self.device), stage, TAG_IDS)

    def recv_ids(self, batches: Sequence[Any]) -> list[Tensor]:
        """Any other stage, after a token step: every batch's ids as the last stage sampled them."""
        return [self._recv((len(b.seq_index),), torch.long, self.n_stages - 1, TAG_IDS).cpu() for b in batches]

    def flush(self) -> None:
        """Wait for every send still in flight (end of a block: its tensors may be freed after)."""
        for work, _ in self._sending:
            work.wait()
        self._sending = []
