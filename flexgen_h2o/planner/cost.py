"""The cost model: a Plan's prefill and decode time on this machine, from the bytes each lane moves and the FLOPs
each layer does, at the rates calibrate.py measured.

One decode step of the zig-zag schedule visits every schedule layer once; within it, each GPU batch computes
(where the model was timed itself, model_probe.py: its block's measured step at the batch's rows plus the
attention slots past the probe's window; else its linear layers at its row count's rate, its attention over its
own KV window and a fixed per-call cost) and the layer's weights for the next visit are read once for all the
batches. With overlap the reads (weights and KV, one lane: one disk, or one link) run on worker threads beside
compute, so a layer takes the longer of the two; without it, their sum. A prompt pass
is the same with each GPU batch's prompt rows (in prefill chunks) and the prompt's attention. What it does not
model: a run's first pass over weights that are not in the page cache yet (every pass is predicted at the rate
of the later ones), and a VM's speed drift (docs/planner.md, "How good the predictions are").

Disk-homed weights and KV (memmaps of the offload files) are read through the page cache. Of what a step passes
over, the share that fits the RAM the run leaves free (the machine's, or a container's limit, less the run's own
predicted peak) is served by the page cache, a copy at its rate that the compute cores make; the rest waits for
the disk (Linux's refault detection keeps a cyclic pass's cached share resident rather than thrashing it;
docs/planner.md, "Does it choose well?"), and KV writes at the disk's write rate.
"""
from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from flexgen_h2o.formats import WEIGHT_FORMAT, StorageFormat
from flexgen_h2o.models import ModelConfig, build_layers, schedule_groups
from flexgen_h2o.planner.plan import Plan
from flexgen_h2o.weights.placement import is_lookup_table, packed_names, stored_bytes, weight_homes


@dataclass
class Prediction:
    prefill_s: float                     # one block's prompt pass
    decode_s: float                      # one block's decode steps (gen_len - 1 of them)
    block_tokens: int                    # tokens one block generates
    blocks: int = 1                      # blocks the job runs
    limits: dict[str, str] = field(default_factory=dict)   # phase -> what bounds it (compute, weights, kv)
    peak_bytes: dict[str, int] = field(default_factory=dict)   # predicted peak per resource (RAM, GPU, disk)

    @property
    def total_s(self) -> float:
        return self.blocks * (self.prefill_s + self.decode_s)

    @property
    def total_tok_s(self) -> float:
        return self.blocks * self.block_tokens / self.total_s if self.total_s > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {"prefill_s": self.prefill_s * self.blocks, "decode_s": self.decode_s * self.blocks,
                "total_s": self.total_s, "total_tok_s": self.total_tok_s, "limits": self.limits,
                "peak_bytes": self.peak_bytes}


PROBE_ROWS = (1, 4, 16, 64, 128)         # decode-step rows a model's own matrices are timed at (calibrate.py)
PROBE_PROMPT = 16                        # model_probe.py's prompt; its decode window, about PROBE_PROMPT + 4 slots,
PROBE_WINDOW = PROBE_PROMPT + 4          # is inside its block times: the cost model adds only the slots beyond
PROBE_MAX_ELEMENTS = 16 << 20            # a probed matrix keeps at most this many elements (rows cut, not inputs)


@functools.lru_cache(maxsize=64)      # the search predicts thousands of plans of one model
def probe_shapes(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """The (out, in) shapes of one transformer block's matrices as the linear probe times them: the model's own
    input widths (what a memory-bound kernel's speed depends on), outputs cut to PROBE_MAX_ELEMENTS."""
    out = []
    for layer in build_layers(cfg):
        if layer.kind in ("attn", "mlp") and not any(kind == layer.kind for kind, _ in out):
            out += [(layer.kind, tuple(s.shape)) for s in layer.weight_specs() if len(s.shape) == 2]
    return tuple((min(n, max(1, PROBE_MAX_ELEMENTS // k)), k) for _, (n, k) in out)


def probe_key(cfg: ModelConfig, fmt_name: str) -> str:
    """The cache key of a model's linear probe in one weight format: its shapes, not its name."""
    return fmt_name + ":" + ",".join(f"{n}x{k}" for n, k in probe_shapes(cfg))


def linear_points(rates: dict[str, Any], fmt_name: str, cfg: ModelConfig) -> list[tuple[int, float]]:
    """(rows, GFLOP/s) of the linear layers: the model's own probe where it was measured (decode rows), the
    generic matrix's above it (prompt chunks, compute-bound: shapes matter less there)."""
    generic = rates["linear_GFLOPs"].get(fmt_name) or rates["linear_GFLOPs"]["fp16"]
    own = rates.get("model_linear_GFLOPs", {}).get(probe_key(cfg, fmt_name), {})
    top = max((int(k) for k in own), default=0)
    pts = {int(k): v for k, v in generic.items() if int(k) > top}
    pts.update({int(k): v for k, v in own.items()})
    return sorted(pts.items())


def block_points(rates: dict[str, Any], fmt_name: str, cfg: ModelConfig) -> list[tuple[int, float]]:
    """(rows, seconds) a transformer block adds to a decode step, timed on the model itself (model_probe.py);
    empty when it was not."""
    own = rates.get("model_block", {}).get(probe_key(cfg, fmt_name), {})
    return sorted((int(k), v) for k, v in own.get("decode_s", {}).items())


def _block_s(pts: list[tuple[int, float]], rows: float) -> float:
    """A block's decode seconds at `rows`: linear in rows between the probe's row counts (a step's time is about
    affine in its rows), in proportion to the rows beyond the largest (compute-bound there), the smallest's below."""
    if rows > pts[-1][0]:
        return pts[-1][1] * rows / pts[-1][0]
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
        if rows <= r1:
            return v0 + (rows - r0) / (r1 - r0) * (v1 - v0)
    return pts[-1][1]


def _rate(pts: list[tuple[int, float]], rows: float) -> float:
    """A measured rate at `rows`, interpolated in log(rows) between the measured (row count, rate) points, sorted
    (flat beyond them)."""
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
        if rows <= r1:
            f = math.log(rows / r0) / math.log(r1 / r0)
            return v0 + f * (v1 - v0)
    return pts[-1][1]


@dataclass(frozen=True)
class LayerCost:
    """One schedule layer as the cost model counts it."""
    flops_per_row: float                 # linear FLOPs per token row
    attn: bool                           # holds an attention layer (reads KV)
    disk_bytes: int                      # its weights' bytes homed on disk
    host_bytes: int                      # ... in host memory (crosses the link on a GPU)
    head: bool = False                   # the LM head: one row per sequence, at prefill too
    block: bool = False                  # holds a transformer block's attention or MLP (probed as a whole)


@functools.lru_cache(maxsize=512)
def layer_costs(cfg: ModelConfig, fractions: tuple[float, float, float], fmt: StorageFormat,
                sep_layer: bool) -> tuple[LayerCost, ...]:
    """Each schedule layer's FLOPs per row and weight bytes by home (cached: the search asks for the same few
    placements at every batch size)."""
    layers = build_layers(cfg)
    packed = packed_names(layers) if fmt.quantized else set()
    homes = weight_homes(layers, fractions, fmt)
    out = []
    for group in schedule_groups([layer.kind for layer in layers], sep_layer):
        flops, disk, host, attn, head, block = 0.0, 0, 0, False, False, False
        for i in group:
            layer = layers[i]
            attn |= layer.kind == "attn"
            head |= layer.kind == "head"
            block |= layer.kind in ("attn", "mlp")
            for spec in layer.weight_specs():
                if len(spec.shape) == 2 and not is_lookup_table(layer, spec):
                    flops += 2.0 * spec.numel
                nbytes = stored_bytes(spec, fmt, packed)
                if homes[spec.name] == "disk" and not is_lookup_table(layer, spec):
                    disk += nbytes
                elif homes[spec.name] == "host":
                    host += nbytes
        out.append(LayerCost(flops, attn, disk, host, head, block))
    return tuple(out)


def _decode_matrices_s(g: LayerCost, rows: int, linear: list, probed: list, block_flops: float,
                       fixed: float) -> float:
    """One GPU batch of `rows` through a schedule layer in a decode step, attention's window aside: the model's own
    block, its share by FLOPs, where it was probed; else its matrices at the measured rate and a fixed call cost."""
    if probed and g.block:
        return _block_s(probed, rows) * g.flops_per_row / block_flops
    return g.flops_per_row * rows / (_rate(linear, rows) * 1e9) + fixed


def decode_layer_s(cfg: ModelConfig, rates: dict[str, Any], rows: int, sep_layer: bool) -> list[float]:
    """Each schedule layer's compute seconds in a decode step of one GPU batch of `rows`, fp16 weights resident (a
    pipeline's stage split weighs the layers by these)."""
    groups = layer_costs(cfg, (1.0, 0.0, 0.0), WEIGHT_FORMAT, sep_layer)
    linear, probed = linear_points(rates, "fp16", cfg), block_points(rates, "fp16", cfg)
    block_flops = sum(g.flops_per_row for g in groups if g.block) / max(1, cfg.n_layers)
    return [_decode_matrices_s(g, rows, linear, probed, block_flops, rates["fixed_decode_s_per_layer"])
            for g in groups]


def page_cache_room(checked: list[Any] | None) -> int | None:
    """RAM the page cache keeps beside a run: the RAM check's available less the run's predicted peak (None: no
    check, assume room)."""
    ram = next((c for c in checked or [] if c.resource == "RAM"), None)
    return None if ram is None else max(0, ram.available - ram.need)


def page_reads(plan: Plan, window: float, n_attn: int) -> tuple[float, float]:
    """Slots a decode step reads per (sequence, KV head, attention layer), averaged over the layers, and what it
    scores to choose them: the window and nothing, or under page selection (kv/page_rule.py) the pages it reads
    and the page summaries ("bound") or the int4 key rows ("keys") of the layers that select."""
    pages = plan.eviction.pages
    if pages is None:
        return window, 0.0
    dense = min(pages.dense_layers, n_attn) / n_attn
    sparse = min(window, pages.pages_read(int(window)) * pages.page_size)
    scored = window / pages.page_size if pages.score == "bound" else window
    return dense * window + (1 - dense) * sparse, (1 - dense) * scored


def predict(plan: Plan, rates: dict[str, Any], *, n_prompts: int | None = None, free_ram: int | None = None,
            peak_bytes: dict[str, int] | None = None) -> Prediction:
    """Predicted times of one block of `plan` (and of the job: ceil(n_prompts / block) blocks). free_ram: RAM the
    page cache can hold disk-homed weights and KV in beside the run's own peak (None: assume they fit)."""
    cfg, off = plan.model, plan.offload
    gpu = rates.get("gpu") if plan.device_type == "cuda" else None
    r = gpu or rates
    fmt_w = off.weight_format.name if off.weight_format.quantized else "fp16"
    linear = linear_points(r, fmt_w, cfg)
    kv_name = plan.kv_format.name if plan.kv_format.quantized else "fp16"
    ns_slot = r.get(f"decode_ns_per_slot_{kv_name}", r["decode_ns_per_slot_fp16"]) * 1e-9
    groups = layer_costs(cfg, off.tier_fractions("weights"), off.weight_format, off.sep_layer)
    full = plan.policy == "full"
    # the decode window: a full cache's grows from the prompt (each column reads its own extent), a budget's is fixed
    window = plan.prompt_len + plan.gen_len / 2 if full else plan.capacity
    n_attn = max(1, sum(g.attn for g in groups))
    read_window, summary_slots = page_reads(plan, window, n_attn)
    # the share of disk reads the page cache serves: what fits beside the run, of what it passes over each step
    demand = ((0 if off.uncached_disk_weights else sum(g.disk_bytes for g in groups))
              + plan.kv_bytes().get("disk", 0) * read_window / window)
    hit = 1.0 if free_ram is None or demand <= free_ram else free_ram / demand
    hit_w = 0.0 if off.uncached_disk_weights else hit
    page_cache, disk_read = rates["page_cache_read_GBps"] * 1e9, rates["disk_read_GBps"] * 1e9
    w_read = hit_w / page_cache + (1 - hit_w) / disk_read                  # seconds per disk byte read
    kv_read = hit / page_cache + (1 - hit) / disk_read
    kv_write = hit / (rates["memcpy_GBps"] * 1e9) + (1 - hit) / (rates["disk_write_GBps"] * 1e9)
    link = gpu["h2d_GBps"] * 1e9 if gpu else math.inf
    slot_bytes = plan.slot_bytes() / max(1, cfg.n_kv_heads)        # one slot of one KV head, with score/pos
    attn_flops_tok = 4 * cfg.n_heads * cfg.head_dim                   # QK^T and PV per query per key
    prompt_rate = r["prompt_scored_GFLOPs" if plan.needs_scores else "prompt_plain_GFLOPs"] * 1e9
    fixed_dec, fixed_pre = r["fixed_decode_s_per_layer"], r["fixed_prefill_s_per_layer"]
    kv_fr = off.tier_fractions("cache")
    # page selection copies the pages it reads (kv/pages.py); a plain cache may be read where it lies
    in_place = (plan.eviction.pages is None
                and off.kv_read_in_place(plan.device_type, plan.eviction.position_rolling, off.gpu_batch_size))
    probed = block_points(r, fmt_w, cfg)
    block_flops = sum(g.flops_per_row for g in groups if g.block) / max(1, cfg.n_layers)
    sizes = collections.Counter(b.size for b in plan.batches)        # GPU batches by row count

    def layer_s(g: LayerCost, compute: float, io_kv: float, totals: dict[str, float]) -> float:
        """A schedule layer's seconds: its weights' reads (once for all GPU batches) share the KV's lane, which
        runs beside compute with overlap, else after it; each lane's time is added to `totals`."""
        io_w = g.disk_bytes * w_read + (g.disk_bytes + g.host_bytes) / link
        if not gpu:
            # a page-cache read is a copy the compute cores make, at the page-cache read's rate (not the memory's)
            compute += g.disk_bytes * hit_w / page_cache
        for k, v in (("compute", compute), ("weights", io_w), ("kv", io_kv)):
            totals[k] += v
        return max(compute, io_w + io_kv) if off.overlap else compute + (io_w + io_kv)

    # --- one decode step ---
    step, bound = 0.0, {"compute": 0.0, "weights": 0.0, "kv": 0.0}
    for g in groups:
        compute = io_kv = 0.0
        for rows, n in sizes.items():
            compute += n * _decode_matrices_s(g, rows, linear, probed, block_flops, fixed_dec)
            if g.attn:
                slots = n * rows * cfg.n_kv_heads * read_window * cfg.n_layers / n_attn
                beyond = max(0.0, read_window - PROBE_WINDOW) / read_window if probed else 1.0
                compute += slots * ns_slot * beyond
                # choosing the pages: a pass over the page summaries at the copy rate, or attention over the int4
                # copy of the keys at the compressed cache's rate
                scored = n * rows * cfg.n_kv_heads * summary_slots * cfg.n_layers / n_attn
                if plan.eviction.pages is not None and plan.eviction.pages.score == "keys":
                    compute += scored * r.get("decode_ns_per_slot_int4-g64", r["decode_ns_per_slot_fp16"]) * 1e-9
                else:
                    compute += (scored * 2 * cfg.head_dim * plan.compute_itemsize / (rates["memcpy_GBps"] * 1e9))
                if not in_place:                 # a staged copy of the window (split, disk, or rolling cache)
                    compute += slots * cfg.head_dim * 2 * 4 / (rates["memcpy_GBps"] * 1e9)
                if gpu:
                    io_kv += slots * slot_bytes * (kv_fr[1] + kv_fr[2]) / link
                elif kv_fr[2]:
                    read = slots * slot_bytes * kv_fr[2]
                    new_slots = n * rows * cfg.n_kv_heads * cfg.n_layers / n_attn     # one per row and KV head
                    io_kv += read * kv_read + new_slots * slot_bytes * kv_fr[2] * kv_write
                    compute += read * hit / page_cache         # a page-cache read: a copy by the compute cores
        step += layer_s(g, compute, io_kv, bound)

    # --- the prompt pass ---
    prefill, pre_bound = 0.0, {"compute": 0.0, "weights": 0.0, "kv": 0.0}
    chunk_rows = plan.prefill_rows * plan.prompt_len
    for g in groups:
        compute = io_kv = 0.0
        for rows, n in sizes.items():
            chunks = math.ceil(rows / plan.prefill_rows)
            tokens = rows if g.head else rows * plan.prompt_len
            rate_rows = plan.prefill_rows if g.head else chunk_rows
            # the prompt pass stays on the machine rates: a probe's one 256-token prompt runs its GEMMs at 256
            # rows, a run's chunks at thousands (docs/planner.md, "How good the predictions are")
            compute += n * (g.flops_per_row * tokens / (_rate(linear, rate_rows) * 1e9) + fixed_pre * chunks)
            if g.attn:
                per_layer = rows * attn_flops_tok * plan.prompt_len ** 2 / 2
                compute += n * per_layer * cfg.n_layers / n_attn / prompt_rate
                if not gpu:          # the prompt's KV written to its disk part
                    written = n * rows * plan.prompt_len * cfg.n_kv_heads * cfg.n_layers / n_attn * slot_bytes
                    io_kv += written * kv_fr[2] * kv_write
        prefill += layer_s(g, compute, io_kv, pre_bound)
    steps = max(0, plan.gen_len - 1)
    blocks = math.ceil((n_prompts or plan.n_seqs) / max(1, plan.offload.block_size))
    return Prediction(prefill, step * steps, plan.n_seqs * plan.gen_len, blocks,
                      {"prefill": max(pre_bound, key=pre_bound.__getitem__),
                       "decode": max(bound, key=bound.__getitem__)}, dict(peak_bytes or {}))
