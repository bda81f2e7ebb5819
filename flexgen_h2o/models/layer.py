"""Data contracts between the model math and everything that places or schedules it.

A layer receives tensors that are already staged on the compute device and returns tensors. It never sees a
tier, a stream or the schedule's indices (`docs/architecture.md`). Shape letters: b sequences, t new tokens, s KV slots,
h query heads, g KV heads, d head dim, m model width, V vocab.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import torch
from torch import Tensor

from flexgen_h2o.formats import FP16, StorageFormat
from flexgen_h2o.models.ops import TORCH, TorchKernels, rope_cos_sin


@dataclass(frozen=True)
class WeightSpec:
    key: str                     # name inside the layer, e.g. "q_proj.weight"
    name: str                    # store-wide name and file stem, e.g. "layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    hf_name: str                 # name in an HF state dict, e.g. "model.decoder.layers.3.self_attn.q_proj.weight"
    init: str = "normal"         # dummy-weight init: "normal" (std 0.02), "ones" (norm gains) or "zeros" (biases)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class KVSpec:
    """Shape of one token row of one attention layer's cache, for one sequence."""
    n_kv_heads: int
    head_dim: int

    def row_bytes(self, fmt: StorageFormat = FP16) -> int:
        """K + V bytes in the cache's format plus the fp32 score and int32 position that travel with every slot,
        per KV head."""
        return self.n_kv_heads * (2 * fmt.nbytes(self.head_dim, self.head_dim) + 4 + 4)


@dataclass
class StepContext:
    positions: Tensor            # (b, t) long: position of each new token for RoPE/learned embeddings; pads -1
    token_valid: Tensor          # (b, t) bool: False for left-padding
    compute_dtype: torch.dtype   # fp32 on CPU, fp16 on CUDA (chosen by the backend)
    want_scores: bool = False    # the eviction policy needs per-key attention mass
    keys_pre_rope: bool = False  # position rolling: store keys before RoPE, rotate by rank at attention time
    score_reduce: str = "sum"    # pooling of grouped query heads into one KV head's score: "sum" or "mean"
    # a prompt's keys are scored by the last score_window rows' queries only (ops.score_start); None: every real one
    score_window: int | None = None
    query_chunk: int = 256       # prefill queries per chunk when scores are wanted (never a full s x s matrix)
    unpadded: bool = False       # no pads in any sequence: a prompt's mask is purely causal (decided on the host)
    # a prompt's leading pads per sequence (left padding), counted on the host; None at decode or where some
    # sequence has a pad after a real token. Batch-invariant kernels attend each sequence on its own tokens alone
    pad_counts: tuple[int, ...] | None = None
    # a prompt's rows whose own budgets evict, where want_scores holds for the block: sequence by sequence, a row
    # whose budget keeps its whole run attends as the full cache does, as it would alone (None: every row)
    score_rows: tuple[bool, ...] | None = None
    kernels: TorchKernels = TORCH  # the math's kernels, resolved once per engine (flexgen_h2o.kernels.resolve)
    # decode: the rows whose results are read (a refilled block's busy rows), None for every row; the linear
    # layers skip the others, whose hidden states and KV writes are never read
    live: Tensor | None = None
    # (id of the frequencies' tensor, dtype) -> (cos, sin) of these positions; rows() starts a fresh dict
    _rope: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def rope(self, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin (b, 1, t, d) of these positions, shared by the heads, computed once per step: a model's layers
        share one frequency tensor (transformer._inv_freq), and each computation is a few parallel regions on a
        CPU, each of which wakes the sleeping OpenMP threads (`docs/architecture.md` "How a token flows")."""
        key = (id(inv_freq), dtype)
        found = self._rope.get(key)
        if found is None:
            cos, sin = rope_cos_sin(self.positions, inv_freq, dtype)
            # the tuple holds the id's owner, so the id cannot be reused while the entry lives
            found = self._rope[key] = (inv_freq, cos[:, None].contiguous(), sin[:, None].contiguous())
        return found[1], found[2]

    def take_live(self, x: Tensor) -> Tensor:
        """x's live rows (dim 0), for the linear layers: on a CPU a free row costs as much as a busy one, so a
        refilled block at a job's tail would otherwise compute its idle rows."""
        return x if self.live is None else x.index_select(0, self.live)

    def spread(self, part: Tensor, rows: int) -> Tensor:
        """take_live's inverse: `part` back in a tensor of `rows` rows, zeros in the rows that are not live."""
        if self.live is None:
            return part
        return part.new_zeros((rows, *part.shape[1:])).index_copy_(0, self.live, part)

    def rows(self, lo: int, hi: int) -> "StepContext":
        """The context of sequences [lo, hi) only (a prefill chunk): a chunk of an unpadded block is unpadded;
        one of a padded block keeps the general mask (still exact) rather than re-checking on the device."""
        pads = None if self.pad_counts is None else self.pad_counts[lo:hi]
        scored = None if self.score_rows is None else self.score_rows[lo:hi]
        return dataclasses.replace(self, positions=self.positions[lo:hi], token_valid=self.token_valid[lo:hi],
                                   pad_counts=pads, score_rows=scored)

    @staticmethod
    def leading_pads(token_valid: Tensor) -> tuple[int, ...] | None:
        """Per sequence of a host (b, t) mask, its count of leading pads, or None if a pad follows a real token."""
        pads = (~token_valid).sum(1)
        left = torch.arange(token_valid.shape[1]) >= pads[:, None]
        return tuple(pads.tolist()) if torch.equal(left, token_valid) else None


@dataclass
class KVView:
    """A staged window of one (layer, GPU batch) cache, in compute dtype on the attention device."""
    k: Tensor                    # (b, g, s, d); post-RoPE at true positions, or pre-RoPE when rolling
    v: Tensor                    # (b, g, s, d)
    valid: Tensor                # (b, g, s) bool: slot holds a real token (pads and empty slots are False)
    write_slot: Tensor           # (b, g) long: the free slot the new token is written into before attending
    key_positions: Tensor | None = None   # (b, g, s) long: rolling only, positions to rotate cached keys at
    release: Callable[[], None] | None = None   # gives pooled staging buffers back once the step is committed
    # set when k and v are the cache's own narrower window (fp16 or quantized rows on a CPU), read only: attention
    # upcasts them to this dtype a block of sequences at a time (ops.narrow_decode_attention) and never writes
    # into them
    compute_dtype: torch.dtype | None = None
    format: StorageFormat = FP16          # the stored form of k and v when compute_dtype is set
    key_scale: Tensor | None = None       # (b, g, 1, d) a compressed cache's keys are k * key_scale (kv/cache.py)
    # (b, g) long, set where k and v are a pool of rows (b, T, width) holding heads of different lengths (a
    # head-adaptive cache read in place, kv/ragged.py): column (b, g)'s slot i is row col_start[b, g] + i
    col_start: Tensor | None = None
    # set on a lazy view (a cache that reads only the pages a query needs, kv/pages.py): the attention layer calls
    # it with the step's query (b, h, 1, d), after RoPE, and attends over the view it returns
    select: Callable[[Tensor], "KVView"] | None = None


@dataclass
class LayerOutput:
    hidden: Tensor                       # (b, t, m), or logits (b, V) / (b, t, V) from the head
    k_new: Tensor | None = None          # (b, g, t, d), in the form the cache stores
    v_new: Tensor | None = None          # (b, g, t, d)
    scores: Tensor | None = None         # (b, g, s) fp32 attention mass per key this step (view slots, or prompt)


class Layer(Protocol):
    name: str                            # "embed", "attn.3", "mlp.3", "head"
    kind: str                            # "embed", "attn", "mlp", "head"

    def weight_specs(self) -> list[WeightSpec]: ...

    def kv_spec(self) -> KVSpec | None: ...

    def forward(self, x: Tensor, w: Mapping[str, Tensor], kv: KVView | None, ctx: StepContext) -> LayerOutput: ...


@dataclass(frozen=True)
class ElsewhereLayer:
    """A layer another pipeline stage holds: in the flat list for its index and kind, with nothing placed here."""
    kind: str

    def weight_specs(self) -> list[WeightSpec]:
        return []

    def kv_spec(self) -> KVSpec | None:
        return None
