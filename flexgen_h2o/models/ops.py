"""Pure tensor math shared by the model families: norms, RoPE, grouped attention with per-key mass, linears.
No state, no placement. Conventions follow transformers' modeling_opt.py / modeling_llama.py (rotate_half RoPE,
fp32 RMSNorm) so that logits match to fp32 rounding. Plain torch only: the reference the compiled kernels
(flexgen_h2o/kernels) are tested against, and (TorchKernels) the layers' math where no compiled kernel is chosen.
"""
from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from flexgen_h2o.models.per_sequence import per_sequence_attention

if TYPE_CHECKING:
    from flexgen_h2o.models.layer import KVView, StepContext


# --- norms ---

def embedding(ids: Tensor, table) -> Tensor:
    """Rows of an embedding table: a tensor, or a staged table that reads rows on demand (anything with
    `lookup(ids)`, e.g. an offloaded table, so a lookup never stages the whole table)."""
    return table.lookup(ids) if hasattr(table, "lookup") else F.embedding(ids, table)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # fp32 statistics, as HF's LlamaRMSNorm, so that fp16 compute on CUDA does not lose the mean square
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# --- rotary positions ---

def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> Tensor:
    """Inverse frequencies (d/2,), computed from theta (never loaded), with optional llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv_freq
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between interpolated smoothly
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin of shape positions.shape + (d,), computed in fp32."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)   # (..., d/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., d) rotated by the angles in cos/sin, which broadcast against x."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# --- attention ---

def causal_pad_mask(token_valid: Tensor) -> Tensor:
    """(b, 1, t, t) bool mask for a prompt: causal, pad keys hidden; a pad query sees itself (no empty row)."""
    b, t = token_valid.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=token_valid.device).tril()
    mask = causal & token_valid[:, None, :]
    mask = mask | torch.eye(t, dtype=torch.bool, device=token_valid.device)
    return mask[:, None]


# The scored path materialises fp32 logits and probabilities one block of queries at a time: a block under glibc's
# mmap threshold (32 MB) reuses its pages instead of faulting fresh ones on every allocation
SCORE_BLOCK_BYTES = 16 << 20
MIN_QUERY_CHUNK = 32             # fewer queries per block and the per-block op overhead starts to show


def score_block_cap(device_type: str) -> int:
    """The byte cap of one scored block: a CPU's (glibc's mmap threshold, its caches); a GPU's blocks: query_chunk."""
    return SCORE_BLOCK_BYTES if device_type == "cpu" else 1 << 62


def score_blocking(batch: int, heads: int, keys: int, queries: int, query_chunk: int, cap: int) -> tuple[int, int]:
    """(sequences, queries) of one scored block of fp32 logits: every sequence at once if a MIN_QUERY_CHUNK block
    of all of them fits the cap, else as many sequences as fit; then as many queries as fit, up to query_chunk."""
    rows = batch
    if queries > 1 and batch > 1 and batch * heads * keys * 4 * MIN_QUERY_CHUNK > cap:
        rows = max(1, cap // (heads * keys * 4 * MIN_QUERY_CHUNK))
    return rows, min(queries, query_chunk, max(MIN_QUERY_CHUNK, cap // (rows * heads * keys * 4)))


def score_block_bytes(batch: int, heads: int, tokens: int, query_chunk: int, device_type: str) -> int:
    """Bytes of the largest fp32 logits block a scored prompt pass of `batch` x `tokens` makes (the planner's
    workspace estimate uses it, so the estimate follows the blocks the engine really allocates)."""
    rows, chunk = score_blocking(batch, heads, tokens, tokens, query_chunk, score_block_cap(device_type))
    return rows * heads * chunk * tokens * 4


def score_start(t: int, score_window: int | None) -> int:
    """The first of a prompt's t query rows that score the keys: 0 (every valid query), or the last score_window
    rows (with left padding, the last real queries)."""
    return 0 if score_window is None else max(0, t - score_window)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, *, want_scores: bool = False,
                      query_valid: Tensor | None = None, score_reduce: str = "sum", query_chunk: int = 256,
                      causal_only: bool = False, score_from: int = 0) -> tuple[Tensor, Tensor | None]:
    """Softmax attention of h query heads over g KV heads without repeating K/V.

    q (b, h, t, d); k, v (b, g, s, d); mask (b, 1 or g, t, s) bool, True = may attend; with s == t the keys
    are the queries' own tokens and the mask is causal (a prompt), so keys after a query chunk are skipped.
    Returns out (b, h, t, d) and, if want_scores, the fp32 attention mass each key received (b, g, s), summed
    over valid queries from row score_from on (score_start) and pooled over the query heads of its group (sum, or
    mean over the group).
    causal_only: the caller knows this is a prompt without pads, so `mask` is purely causal (faster paths).
    query_chunk: the most prompt queries per scored block; SCORE_BLOCK_BYTES may make blocks smaller.
    """
    b, h, t, d = q.shape
    g, s = k.shape[1], k.shape[2]
    r = h // g
    no_pads = causal_only and t == s and t > 1
    if not want_scores and t > 1:
        # fused kernel for the prompt when nobody needs the probabilities. is_causal lets the kernel skip the
        # blocks above the diagonal, which an explicit mask does not
        if no_pads:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=(r > 1))
            return out, None
        full_mask = mask if mask.shape[1] == 1 else mask.repeat_interleave(r, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=full_mask, scale=scale, enable_gqa=(r > 1))
        return out, None
    rows, chunk = score_blocking(b, h, s, t, query_chunk, score_block_cap(q.device.type))
    if rows < b:
        # even the smallest query block of every sequence would not fit: a few sequences at a time
        parts = [grouped_attention(q[lo:lo + rows], k[lo:lo + rows], v[lo:lo + rows], mask[lo:lo + rows], scale,
                                   want_scores=True, score_reduce=score_reduce, query_chunk=query_chunk,
                                   query_valid=None if query_valid is None else query_valid[lo:lo + rows],
                                   causal_only=causal_only, score_from=score_from) for lo in range(0, b, rows)]
        return torch.cat([o for o, _ in parts]), torch.cat([sc for _, sc in parts])   # t > 1 here: scores wanted
    qg = (q * scale).reshape(b, g, r, t, d)
    # k and v arrive as head views of (b, t, heads * d) projections (q * scale above is a new tensor already):
    # a block's matmul over such a view copies it first, and every block re-reads a key and value prefix, so
    # lay them out once
    k, v = k.contiguous(), v.contiguous()
    outs, scores = [], torch.zeros(b, g, s, dtype=torch.float32, device=q.device) if want_scores else None
    # a prompt attending to itself (s == t, causal): queries [start, stop) see only keys [0, stop)
    causal_self = t == s and t > 1
    for start in range(0, t, chunk):
        stop = min(t, start + chunk)
        tc, sk = stop - start, (stop if causal_self else s)
        logits = torch.matmul(qg[:, :, :, start:stop].reshape(b, g, r * tc, d), k[:, :, :sk].transpose(-1, -2))
        logits = logits.view(b, g, r, tc, sk)                                      # (b, g, r, tc, sk)
        # without pads every key before the chunk is visible to all its queries: only the diagonal block masks
        lo = start if no_pads else 0
        logits[..., lo:].masked_fill_(~mask[:, :, None, start:stop, lo:sk], float("-inf"))
        # fp32 probabilities straight from fp16 logits (a GPU's): softmax upcasts as it reads, so no fp32 copy of
        # the logits is written and then masked (`bash scripts/gpu_profile.sh DIR`); a CPU's logits are fp32 already
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        outs.append(torch.matmul(probs.to(v.dtype).view(b, g, r * tc, sk), v[:, :, :sk]).view(b, g, r, tc, d))
        if want_scores and stop > score_from:
            if query_valid is not None and not no_pads:
                probs.mul_(query_valid[:, None, None, start:stop, None])
            counted = probs if start >= score_from else probs[:, :, :, score_from - start:]
            scores[:, :, :sk] += counted.sum(dim=(2, 3))
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    if want_scores and score_reduce == "mean":
        scores /= r
    return out.reshape(b, h, t, d), scores


# Sequences upcast from the cache's narrower rows per block: small enough that a block is multiplied while it is
# still in cache, where the whole window upcast first would be written to DRAM and read back
NARROW_BLOCK_BYTES = 4 << 20


def narrow_decode_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, slot: Tensor, k_new: Tensor,
                            v_new: Tensor, scale: float, *, want_scores: bool = False,
                            score_reduce: str = "sum", fmt=None) -> tuple[Tensor, Tensor | None]:
    """One decode step's attention over a window stored narrower than the compute dtype (fp16 or quantized KV on
    a CPU; fmt: the window's StorageFormat, None for a plain one).

    q (b, h, 1, d) in compute dtype; k, v (b, g, s, d) the cache's own window (s rows of fmt.row_width(d) for a
    quantized one), read only; valid (b, g, s) with the new token's slot already set; k_new, v_new (b, g, 1, d)
    in compute dtype go into slot (b, g) of each upcast block, so the new token attends to its unrounded self.
    grouped_attention on the upcast window, one block of sequences at a time (a sequence's softmax is its own)."""
    b, _, _, d = q.shape
    g, s = k.shape[1], k.shape[2]
    dtype = q.dtype
    rows = min(b, max(1, NARROW_BLOCK_BYTES // (g * s * d * dtype.itemsize)))
    scratch = _scratch(2 * rows * g * s * d, dtype, q.device)

    def upcast(window: Tensor, new_row: Tensor, lo: int, at: int) -> Tensor:
        part = window[lo:lo + rows] if fmt is None or not fmt.quantized else fmt.unpack(window[lo:lo + rows], d, dtype)
        n = part.shape[0] * g * s * d
        block = scratch[at * n:(at + 1) * n].view(part.shape[0], g, s, d).copy_(part)
        write_slot(block, slot[lo:lo + rows], new_row[lo:lo + rows])
        return block

    parts = [grouped_attention(q[lo:lo + rows], upcast(k, k_new, lo, 0), upcast(v, v_new, lo, 1),
                               valid[lo:lo + rows, :, None, :], scale, want_scores=want_scores,
                               score_reduce=score_reduce) for lo in range(0, b, rows)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([o for o, _ in parts]), (torch.cat([sc for _, sc in parts]) if want_scores else None)


def column_rows(pool: Tensor, col_start: Tensor, s: int) -> Tensor:
    """(b, g, s, width): slots [0, s) of each column (b, g) of a row pool (b, T, width), from row col_start[b, g]
    (KVView.col_start); slots past a column's rows are its neighbour's, masked as any free slot is."""
    b, t, width = pool.shape
    rows = (col_start.to(pool.device)[:, :, None] + torch.arange(s, device=pool.device)).clamp_(max=t - 1)
    return pool.gather(1, rows.view(b, -1, 1).expand(b, rows[0].numel(), width)).view(b, -1, s, width)


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """(b, t, n*d) -> (b, n, t, d)."""
    return x.view(*x.shape[:2], n_heads, -1).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(b, n, t, d) -> (b, t, n*d)."""
    return x.transpose(1, 2).flatten(2)


def write_slot(cache: Tensor, slot: Tensor, row: Tensor) -> None:
    """cache (b, g, s, ...)[b, g, slot[b, g]] = row (b, g, 1, ...), in place: one index_copy_ over a flat view, as
    scatter_ into a half tensor on a CPU rewrites the whole tensor."""
    b, g, s = cache.shape[:3]
    if not cache.is_contiguous():
        index = slot.view(*slot.shape, 1, *([1] * (cache.dim() - 3))).expand(*row.shape)
        cache.scatter_(2, index, row.to(cache.dtype))
        return
    tail = cache.shape[3:]
    rows = torch.arange(b * g, device=slot.device).view(b, g) * s + slot
    cache.view(b * g * s, *tail).index_copy_(0, rows.view(-1), row.reshape(b * g, *tail).to(cache.dtype))


# --- linear layers ---

UPCAST_CHUNK_BYTES = 8 << 20     # weight rows upcast at a time: small enough to stay in cache while multiplied
_local = threading.local()       # one upcast scratch per thread: a fresh 8 MB tensor page-faults on every use
Gemm = Callable[..., Tensor]     # (x, w, b=None) -> x @ w.T + b, x and w of one dtype


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
        buf = _local.scratch = torch.empty(max(numel, UPCAST_CHUNK_BYTES // dtype.itemsize), dtype=dtype,
                                           device=device)
    return buf


def linear(x: Tensor, w: Tensor, b: Tensor | None = None, gemm: Gemm = F.linear) -> Tensor:
    """x @ w.T + b, for a weight stored narrower than x (fp16 staged on a CPU, where x is fp32) too; `gemm`
    multiplies operands of one dtype (kernels.Kernels hands in oneDNN's for a prompt's rows).

    A narrower weight is upcast a few MB of rows at a time into one scratch buffer and multiplied while the rows
    are still in cache, so a step reads the fp16 bytes once (docs/architecture.md, "Numerics"). The product is the
    same GEMM on the same fp32 values, one block of outputs at a time."""
    packed = not isinstance(w, Tensor)          # a quant.PackedMatrix: its rows dequantized a block at a time
    if not packed and w.dtype == x.dtype:
        return gemm(x, w, b)
    rows = max(1, UPCAST_CHUNK_BYTES // (w.shape[1] * x.element_size()))
    if rows >= w.shape[0]:
        whole = w.values(x.dtype) if packed else w.to(x.dtype)
        return gemm(x, whole, None if b is None else b.to(x.dtype))
    out = x.new_empty(*x.shape[:-1], w.shape[0])
    scratch = _scratch(rows * w.shape[1], x.dtype, x.device)
    for start in range(0, w.shape[0], rows):
        stop = min(w.shape[0], start + rows)
        block = scratch[:(stop - start) * w.shape[1]].view(stop - start, w.shape[1])
        block.copy_(w.values(x.dtype, start, stop) if packed else w[start:stop])
        out[..., start:stop] = gemm(x, block)
    if b is not None:
        out += b.to(x.dtype)
    return out


class TorchKernels:
    """The math a layer calls through its StepContext, as the plain torch functions above: the reference the
    compiled kernels are tested against, and the path on CUDA and wherever no compiled kernel is built.
    kernels.Kernels subclasses it and overrides the device-level methods its compiled kernels serve (a CPU's fp32),
    so a layer calls one method per phase, prompt_attention or decode_attention, and never asks which path runs."""
    name = "torch"
    # every op computes a row the same way whatever rows come with it (kernels.Kernels where its compiled kernels
    # serve every call; torch's own GEMMs choose their blocking by the batch's shape)
    batch_invariant = False

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rms_norm(x, weight, eps)

    def apply_rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return apply_rope(x, cos, sin)

    def linear(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        return linear(x, w, b)

    def relu_mlp(self, x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> Tensor:
        return self.linear(torch.relu(self.linear(x, w1, b1)), w2, b2)

    def swiglu_mlp(self, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
        return self.linear(F.silu(self.linear(x, w_gate)) * self.linear(x, w_up), w_down)

    # --- attention, one entry point per phase ---

    def prompt_attention(self, q: Tensor, k: Tensor, v: Tensor, ctx: "StepContext",
                         scale: float) -> tuple[Tensor, Tensor | None]:
        """A prompt attending to itself (causal, pads hidden), with each key's mass (b, g, t) where the rule wants
        scores. Batch-invariant kernels take each sequence alone on its own tokens (per_sequence_attention)."""
        if self.batch_invariant and q.device.type == "cpu" and ctx.pad_counts is not None:
            return per_sequence_attention(self._prompt_attention, q, k, v, ctx, scale)
        return self._prompt_attention(q, k, v, ctx, scale)

    def _prompt_attention(self, q: Tensor, k: Tensor, v: Tensor, ctx: "StepContext",
                          scale: float) -> tuple[Tensor, Tensor | None]:
        if ctx.want_scores:
            return self.scored_prompt_attention(q, k, v, ctx.token_valid, ctx.unpadded, scale, ctx.score_reduce,
                                                ctx.query_chunk, score_window=ctx.score_window)
        return grouped_attention(q, k, v, causal_pad_mask(ctx.token_valid), scale, causal_only=ctx.unpadded)

    def decode_attention(self, q: Tensor, k_new: Tensor, v_new: Tensor, kv: "KVView", ctx: "StepContext",
                         scale: float, inv_freq: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """One decode step: q (b, h, 1, d) and the new token's k_new, v_new (b, g, 1, d), on the window's device
        and in its compute dtype. The new token takes its free slot (kv.write_slot) first, so it attends to itself
        as any kept token does; then attention over the window's valid slots, with each slot's mass (b, g, s)
        where the rule wants scores. The cache's own narrower window (kv.compute_dtype set) is read in place and
        never written; a staged window gets the new row, and rolled keys are rotated by rank (kv.key_positions,
        with the layer's RoPE frequencies inv_freq)."""
        kv.valid.scatter_(2, kv.write_slot.unsqueeze(-1), True)
        want, reduce = ctx.want_scores, ctx.score_reduce
        if kv.compute_dtype is not None:
            if kv.key_scale is not None:     # stored keys are k / key_scale: the scale goes into the query
                b, h, _, d = q.shape
                g = kv.key_scale.shape[1]
                q = (q.reshape(b, g, h // g, d) * kv.key_scale).reshape(b, h, 1, d)
                k_new = k_new / kv.key_scale
            return self.narrow_decode_attention(q, kv.k, kv.v, kv.valid, kv.write_slot, k_new, v_new, scale,
                                                want_scores=want, score_reduce=reduce, fmt=kv.format,
                                                col_start=kv.col_start)
        write_slot(kv.k, kv.write_slot, k_new)
        write_slot(kv.v, kv.write_slot, v_new)
        keys = kv.k
        if kv.key_positions is not None:     # rolling: every kept key rotated by its rank
            cos, sin = rope_cos_sin(kv.key_positions, inv_freq.to(q.device), q.dtype)    # (b, g, s, d)
            keys = self.apply_rope(keys, cos, sin)
        return self.window_attention(q, keys, kv.v, kv.valid, kv.write_slot, scale, want_scores=want,
                                     score_reduce=reduce)

    # --- the device-level attention the entry points call (kernels.Kernels: the compiled ones on a CPU) ---

    def scored_prompt_attention(self, q: Tensor, k: Tensor, v: Tensor, token_valid: Tensor, unpadded: bool,
                                scale: float, score_reduce: str, query_chunk: int, *,
                                score_window: int | None = None) -> tuple[Tensor, Tensor]:
        """A prompt attending to itself (causal, pads hidden) and each key's mass (b, g, t) from the valid
        queries, or the last score_window rows' (score_start): grouped_attention's scored path."""
        out, scores = grouped_attention(q, k, v, causal_pad_mask(token_valid), scale, want_scores=True,
                                        query_valid=token_valid, score_reduce=score_reduce,
                                        query_chunk=query_chunk, causal_only=unpadded,
                                        score_from=score_start(q.shape[2], score_window))
        return out, scores                                                       # type: ignore[return-value]

    def narrow_decode_attention(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, slot: Tensor,
                                k_new: Tensor, v_new: Tensor, scale: float, *, want_scores: bool = False,
                                score_reduce: str = "sum", fmt=None,
                                col_start: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if col_start is not None:           # a row pool (KVView.col_start): each column's slots gathered first
            k, v = (column_rows(pool, col_start, valid.shape[2]) for pool in (k, v))
        return narrow_decode_attention(q, k, v, valid, slot, k_new, v_new, scale, want_scores=want_scores,
                                       score_reduce=score_reduce, fmt=fmt)

    def key_mass(self, q: Tensor, k: Tensor, valid: Tensor, slot: Tensor, k_new: Tensor, scale: float, fmt) -> Tensor:
        """narrow_decode_attention's mass (b, g, s) over quantized key rows k alone (compiled kernels skip values)."""
        return self.narrow_decode_attention(q, k, k, valid, slot, k_new, k_new, scale, want_scores=True, fmt=fmt)[1]

    def window_attention(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, slot: Tensor, scale: float, *,
                         want_scores: bool = False, score_reduce: str = "sum") -> tuple[Tensor, Tensor | None]:
        """One decode step over a staged window in compute dtype (b, g, s, d) that already holds the new token
        at `slot` (b, g); valid (b, g, s) marks the kept slots and the new one."""
        return grouped_attention(q, k, v, valid[:, :, None, :], scale, want_scores=want_scores,
                                 score_reduce=score_reduce)

    def commit_usable(self, k: Tensor) -> bool:
        """Whether a decode step's commit into a cache of keys `k` goes to a compiled kernel (kv/cache.py)."""
        return False


TORCH = TorchKernels()
