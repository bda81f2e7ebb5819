"""The KV quantizer's inputs of an engine run and of the masked reference, compared code by code.

Two paths that compute K and V in other fp32 orders (this project's kernels, MKL, oneDNN, AVX2 or AVX-512 or
SSE) give inputs a few ulps apart; int4/int8 rounding turns such a difference into a whole level when a value
lies at a rounding boundary. Comparing the codes each path's own inputs give (both through fake_quant: the
engine's GroupQuant is the same torch math, tests/test_compressed_kv checks its stored rows against fake_quant
bit for bit) says exactly which steps read the same rounded history, on any CPU, instead of guessing from a
margin threshold.
"""
from __future__ import annotations

import torch

from flexgen_h2o.kv.cache import KVCache
from flexgen_h2o.kv.ragged import RaggedKVCache
from tests.reference.fake_quant import fake_quant
from tests.tolerances import EPS32


class EngineQuantInputs:
    """Spy on KVCache's commits: per cache, {(row, kv head, position): (key input, value input)}, the rows its
    quantizer is given (keys divided by the cache's channel scale, as KVCache._stored does)."""

    def __init__(self, monkeypatch):
        self.rows: dict[int, dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]]] = {}
        for cls in (KVCache, RaggedKVCache):        # the uniform cache and the head-adaptive one (own commits)
            self._spy_on(cls, monkeypatch)

    def _spy_on(self, cls, monkeypatch) -> None:
        prefill, decode = cls.commit_prefill, cls.commit_decode
        spy = self

        def commit_prefill(cache, k_new, v_new, scores, token_pos, first_row=0, *a, **kw):
            out = prefill(cache, k_new, v_new, scores, token_pos, first_row, *a, **kw)
            if k_new.dtype == torch.uint8:        # Engine.prefill's rows, already stored: quantized when made
                return out
            for b, row in enumerate(token_pos.tolist()):           # after: the channel scale is set by then
                for j, pos in enumerate(row):
                    if pos >= 0:
                        spy._keep(cache, first_row + b, pos, k_new[b, :, j], v_new[b, :, j])
            return out

        def commit_decode(cache, view, out, new_pos):
            for b, pos in enumerate(new_pos.tolist()):               # before: the commit may evict, not rescale
                spy._keep(cache, b, pos, out.k_new[b, :, 0], out.v_new[b, :, 0])
            return decode(cache, view, out, new_pos)

        monkeypatch.setattr(cls, "commit_prefill", commit_prefill)
        monkeypatch.setattr(cls, "commit_decode", commit_decode)

    def _keep(self, cache, b: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (g, d) of sequence row b at `pos`, stored as the cache's quantizer takes them."""
        if not cache.fmt.quantized:
            return
        scale = cache.k_scale[b, :, 0].to(k.device)                                   # (g, d)
        got = self.rows.setdefault(id(cache), {})
        for g in range(k.shape[0]):
            got[(b, g, int(pos))] = ((k[g] / scale[g]).clone(), v[g].clone())

    def by_layer(self, engine) -> dict[int, dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]]]:
        """{attention layer in order: {(sequence, kv head, position): inputs}} of a run's last block: its GPU
        batches hold consecutive sequences, and a batch split across tiers consecutive rows per tier, so a
        cache's row b is sequence (rows before its batch and tier) + b."""
        out: dict = {}
        first = 0
        for caches in engine.last_caches:
            width = 0
            for i, layer in enumerate(sorted(caches)):                     # the engine keys all its layers
                row = first
                for cache in caches[layer].caches:
                    for (b, g, pos), x in self.rows.get(id(cache), {}).items():
                        out.setdefault(i, {})[(row + b, g, pos)] = x
                    row += cache.k.shape[0]
                width = row - first
            first += width
        return out


def reference_inputs(quant_log: dict, mask: torch.Tensor) -> dict[int, dict[tuple[int, int, int], tuple]]:
    """The reference's quant_log (reference_generate) keyed like EngineQuantInputs: cache index i of sequence b
    holds the prompt's real token i - (width - length) or the decode token width + t at position length + t."""
    width, lengths = mask.shape[1], mask.sum(1).tolist()
    out = {}
    for layer, (_, value, _, key_in) in quant_log.items():
        rows = {}
        n = key_in.shape[2]
        for b, length in enumerate(lengths):
            for i in range(width - length, n):
                pos = i - (width - length)
                for g in range(key_in.shape[1]):
                    rows[(b, g, pos)] = (key_in[b, g, i], value[b, g, i])
        out[layer] = rows
    return out


def first_flipped_step(got: dict, want: dict, lengths: list[int], bits: int, n_steps: int,
                       group: int = 64) -> tuple[list[int], float]:
    """Per sequence, the first decode step that reads a K or V row whose codes differ between `got` (a path's
    quantizer inputs) and `want` (the reference's): n_steps where none does; and the largest input difference.

    A row at position pos of a sequence of `length` prompt tokens is first read rounded at step
    max(1, pos - length + 2) (step 0 is the prompt pass; step t reads the rows before its own, position
    length + t - 1). Rows only one side quantized (evicted in the prompt pass, or the last step's own) are
    never read rounded by both and are skipped. Every flip must be a near tie: the reference's margin (its
    least distance from a rounding boundary, fake_quant's, in the quantizer's input units) is at most
    2 delta + 8 EPS32 max|x|, delta the row's input difference: a value moves by delta, the group's min and
    (max - min) / levels * levels by 2 delta at most, and each path's (x - min) / step rounds twice (a relative
    EPS32 of |x - min| <= 2 max|x| each). A far value rounded apart is a bug (a wrong scale, row or group)."""
    first, delta = [n_steps] * len(lengths), 0.0
    for layer in sorted(want):
        keys = sorted(set(got[layer]) & set(want[layer]))
        for side in (0, 1):                                             # keys, then values
            a = torch.stack([got[layer][k][side] for k in keys]).float()
            b = torch.stack([want[layer][k][side] for k in keys]).float()
            margins: list = []
            flipped = (fake_quant(a, bits, group) != fake_quant(b, bits, group, margins)).any(-1)
            diff = (a - b).abs().amax(-1)
            delta = max(delta, float(diff.max()))
            bound = 2 * diff + 8 * EPS32 * b.abs().amax(-1)
            far = flipped & (margins[0] > bound)
            assert not bool(far.any()), f"layer {layer}: rows {[keys[i] for i in far.nonzero()[:, 0].tolist()]} " \
                                        f"rounded apart far from a boundary"
            for i in flipped.nonzero()[:, 0].tolist():
                seq, _, pos = keys[i]
                first[seq] = min(first[seq], max(1, pos - lengths[seq] + 2))
    return first, delta
