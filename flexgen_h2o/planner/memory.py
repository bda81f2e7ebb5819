"""Per-tier memory estimate of a run, before anything is loaded: weights, KV, activations, workspace.

The numbers follow what the engine really allocates, so a preflight refusal is about real bytes:
- weights: FlexGen's midpoint rule per model layer (`weights.placement.weight_homes`, the function the engine
  uses). Compute-homed weights are kept in `placement.resident_dtype` (on a CPU, matrices fp16 and vectors fp32;
  on a GPU the compute dtype); host-homed weights stay fp16 in RAM; disk-homed weights stay in the store's files.
- KV: every (attention layer, GPU batch) cache holds `Budget.capacity` slots per sequence and KV head, each slot
  K + V in the KV dtype plus an fp32 score and an int32 position (`KVCache`); its sequences are split across
  tiers by the cache percents, by whole sequences (`config.split_by_fraction`, the split the engine uses).
- activations: the hidden state of every GPU batch rests between layers; off-compute parts get a prefill-sized
  and a decode-sized buffer; plus the batch's step-0 logits. Prefilled by rows (`OffloadPolicy.prefill_by_rows`),
  the prompt's hidden state is one chunk's (counted in the workspace), so only the decode-sized buffers rest.
- workspace: transients on the compute tier: staged weights (the current and, with overlap, the next schedule
  layer), staged KV windows (on a CPU an fp16 cache is read in place), and the largest intermediate of one GPU
  batch at prefill.
- beyond the tiers (a CPU run only, where the compute tier is RAM): what glibc's malloc keeps resident beyond
  the bytes live (`allocator_bytes`); the preflight adds it, the code a run maps and the process's own RSS to
  the RAM it checks.
Imports: config, models, kv budgets and the placement rule only (docs/architecture.md, "Memory accounting").
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.formats import StorageFormat
from flexgen_h2o.kernels import onednn_may_run
from flexgen_h2o.kv import Budget, EvictionConfig
from flexgen_h2o.kv.page_rule import PageRule
from flexgen_h2o.kv.pages import SKETCH
from flexgen_h2o.models import KVSpec, ModelConfig, all_specs, build_layers, schedule_groups
from flexgen_h2o.planner.plan import Plan
from flexgen_h2o.weights.placement import (is_lookup_table, model_bytes, packed_names, resident_dtype,
                                           stored_bytes, weight_homes)

TIERS = ("compute", "host", "disk")
PARTS = ("weights", "kv", "activations", "workspace")


@dataclass
class Estimate:
    """Bytes per tier and part. `bytes[tier][part]`; disk counts files in the offload dir and new stores."""
    bytes: dict[str, dict[str, int]] = field(default_factory=lambda: {t: dict.fromkeys(PARTS, 0) for t in TIERS})
    budget: Budget | None = None          # the resolved KV slots per (sequence, KV head)
    n_seqs: int = 0                       # sequences in the largest block
    prompt_len: int = 0
    gen_len: int = 0
    kv_bytes: int = 0                     # the real (H2O or full) KV allocation of one block, all tiers
    full_kv_bytes: int = 0                # the same block with a full cache (prompt_len + gen_len slots)
    model_bytes: int = 0                  # fp16 parameters
    store_bytes: int = 0                  # fp16 weights read from an existing store on disk (not offload dir)
    beyond_tiers: dict[str, int] = field(default_factory=dict)  # RAM a CPU run holds that no tier charges
    plan: Plan | None = None              # what was added up

    def tier_total(self, tier: str) -> int:
        return sum(self.bytes[tier].values())

    def add(self, tier: str, part: str, n: int) -> None:
        self.bytes[tier][part] += int(n)


def kv_slot_bytes(model: ModelConfig, fmt: StorageFormat) -> int:
    """One slot of one sequence in one attention layer (KVSpec.row_bytes: K + V, fp32 score, int32 position)."""
    return KVSpec(model.n_kv_heads, model.head_dim).row_bytes(fmt)


def summary_row_bytes(pages: PageRule, capacity: int, head_dim: int, itemsize: int) -> int:
    """Bytes page selection keeps per (sequence, KV head, layer) to score pages: each page's key min and max, or
    an int4 row per slot (and a spare one) for the "keys" score."""
    if pages.score == "bound":
        return -(-capacity // pages.page_size) * 2 * head_dim * itemsize
    return (capacity + 1) * SKETCH.row_width(head_dim)


def kv_row_bytes(model: ModelConfig, fmt: StorageFormat) -> int:
    """One token's K and V in one attention layer, every KV head: what reading it moves."""
    return 2 * model.n_kv_heads * fmt.nbytes(model.head_dim, model.head_dim)


def estimate(model: ModelConfig, offload: OffloadPolicy, eviction: EvictionConfig, *, prompt_len: int,
             gen_len: int, n_seqs: int | None = None, compute_dtype_bytes: int = 4,
             dummy_store_bytes: int = 0, device_type: str | None = None, real_weights: bool = False) -> Estimate:
    """Peak bytes per tier of one block of `n_seqs` prompts (default: a full block) padded to `prompt_len`,
    generating `gen_len` tokens (Plan.for_shape). compute_dtype_bytes: 4 on CPU (fp32 compute), 2 on CUDA.
    dummy_store_bytes: a dummy store that will be written before the run (counted on disk). device_type:
    "cpu" or "cuda"; by default inferred from compute_dtype_bytes, which misreads an fp32 engine on CUDA.
    real_weights: read from a converted store, not drawn through the dummy loader's scratch (allocator_bytes)."""
    device_type = device_type or ("cpu" if compute_dtype_bytes == 4 else "cuda")   # the CLI: fp32 only on a CPU
    plan = Plan.for_shape(model, offload, eviction, prompt_len=prompt_len, gen_len=gen_len, n_seqs=n_seqs,
                          device_type=device_type, compute_itemsize=compute_dtype_bytes)
    return plan_bytes(plan, dummy_store_bytes=dummy_store_bytes, real_weights=real_weights)


def plan_bytes(plan: Plan, *, dummy_store_bytes: int = 0, real_weights: bool = False) -> Estimate:
    """A plan's peak bytes per tier and part, and (a CPU run) what malloc keeps beyond them."""
    model, offload, c = plan.model, plan.offload, plan.compute_itemsize
    est = Estimate(budget=plan.budgets.rows[0], n_seqs=plan.n_seqs, prompt_len=plan.prompt_len,
                   gen_len=plan.gen_len, plan=plan)
    tiers, est.store_bytes, staged, est.model_bytes = _weight_bytes(
        model, offload.tier_fractions("weights"), offload.weight_format, c, plan.device_type, offload.overlap,
        offload.sep_layer)
    for tier, n in tiers:
        est.add(tier, "weights", n)
    est.add("compute", "workspace", staged)
    est.add("disk", "weights", dummy_store_bytes)
    if dummy_store_bytes and offload.weight_format.quantized:
        est.add("disk", "weights", est.model_bytes)     # the packed copy converted beside the store (<fmt>/)
    for tier, n in plan.kv_bytes().items():
        est.add(tier, "kv", n)
    pages = plan.eviction.pages
    if pages is not None:        # page selection's scores' inputs, where it computes (kv/pages.py)
        layers = model.n_layers - min(pages.dense_layers, model.n_layers)
        est.add("compute", "kv", layers * plan.n_seqs * model.n_kv_heads * summary_row_bytes(pages, plan.capacity,
                                                                                            model.head_dim, c))
    est.kv_bytes = sum(est.bytes[t]["kv"] for t in TIERS)
    est.full_kv_bytes = model.n_layers * plan.n_seqs * (plan.prompt_len + plan.gen_len) * plan.slot_bytes()
    for tier, n in plan.activation_bytes().items():
        est.add(tier, "activations", n)

    # --- workspace on the compute tier ---
    gbs = min(offload.gpu_batch_size, plan.n_seqs)
    windows = 2 if offload.overlap else 1
    # staged KV window of the current and the next batch: k and v upcast to compute dtype, plus masks and
    # positions. Where the cache is read in place (OffloadPolicy.kv_read_in_place, the engine's rule), it is
    # upcast a few MB at a time into the linear layers' scratch: only the fp32 logits and probabilities remain
    in_place = offload.kv_read_in_place(plan.device_type, plan.eviction.position_rolling, gbs)
    per_slot = 2 * (model.n_heads // model.n_kv_heads) * 4 if in_place else 2 * model.head_dim * c
    est.add("compute", "workspace", windows * gbs * model.n_kv_heads * plan.capacity * (per_slot + 16))
    est.add("compute", "workspace", plan.layer_workspace())
    if plan.device_type == "cpu":            # on a GPU the transients are device memory, not malloc's
        heap_live = est.bytes["compute"]["activations"] + est.bytes["host"]["activations"]
        for b in plan.batches:
            for lo, hi, tier in b.cache:
                if tier != "disk":         # disk parts are memmaps of the offload files
                    heap_live += model.n_layers * _heap_served(_kv_tensors(model, hi - lo, plan.capacity,
                                                                           plan.kv_format))
        # (the previous block's caches are dropped before a block allocates: Engine._generate_block)
        rows, tokens = plan.prefill_rows, plan.prompt_len
        est.beyond_tiers = allocator_bytes(model, rows, tokens, c, plan.score_block, heap_live,
                                           loader_scratch=0 if real_weights else _dummy_scratch(model))
        if onednn_may_run(rows * tokens):
            est.beyond_tiers["oneDNN"] = ONEDNN_BYTES
    return est


@functools.lru_cache(maxsize=512)
def _weight_bytes(model: ModelConfig, fractions: tuple[float, float, float], fmt: StorageFormat, c: int,
                  device_type: str, overlap: bool,
                  sep_layer: bool) -> tuple[tuple[tuple[str, int], ...], int, int, int]:
    """(weights per tier, store bytes, staging workspace, model bytes) of one weight placement; cached, as the
    placement search asks for the same few placements at every batch size."""
    est = Estimate()
    layers = build_layers(model)
    _weights(est, layers, fractions, fmt, overlap, sep_layer, c, device_type)
    tiers = tuple((t, est.bytes[t]["weights"]) for t in TIERS if est.bytes[t]["weights"])
    return tiers, est.store_bytes, est.bytes["compute"]["workspace"], model_bytes(layers, fmt)


def _weights(est: Estimate, layers: list, fractions: tuple[float, float, float], fmt: StorageFormat, overlap: bool,
             sep_layer: bool, c: int, device_type: str) -> None:
    """Homes by FlexGen's midpoint rule; staged copies of the two largest-staging schedule layers."""
    device, dtype = torch.device(device_type), torch.float32 if c == 4 else torch.float16
    on_cpu = device.type == "cpu"
    packed = packed_names(layers) if fmt.quantized else set()
    home_of = weight_homes(layers, fractions, fmt)
    at_rest_bytes = lambda spec: stored_bytes(spec, fmt, packed)       # noqa: E731
    counted: set[str] = set()
    staged_per_layer: list[int] = []
    for layer in layers:
        staged = 0
        for spec in layer.weight_specs():
            home = home_of[spec.name]
            if spec.name not in counted:           # a tied tensor is resident once, but staged in each layer
                counted.add(spec.name)
                at_rest = at_rest_bytes(spec)
                if home == "compute":
                    est.add("compute", "weights", at_rest if spec.name in packed else
                            spec.numel * resident_dtype(spec.shape, device, dtype).itemsize)
                elif home == "host":
                    est.add("host", "weights", at_rest)
                else:
                    est.store_bytes += at_rest
            if spec.name in packed:
                # placement._stage_one: a CPU multiplies packed rows where they lie (a disk read: its pooled
                # buffer); a GPU dequantizes every packed matrix, compute-homed too, into a buffer of its dtype
                staged += (at_rest_bytes(spec) if home == "disk" else 0) if on_cpu else spec.numel * c
            elif home != "compute" and not is_lookup_table(layer, spec):
                # matrices stay fp16 (a host one on a CPU is used in place); vectors take the compute dtype;
                # offloaded embedding tables are read by row, never staged
                matrix = len(spec.shape) > 1
                staged += 0 if (matrix and home == "host" and on_cpu) else spec.numel * (2 if matrix else c)
        staged_per_layer.append(staged)
    groups = schedule_groups([layer.kind for layer in layers], sep_layer)
    per_group = sorted((sum(staged_per_layer[i] for i in g) for g in groups), reverse=True)
    # with overlap the next schedule layer is prefetched while the current one computes
    est.add("compute", "workspace", sum(per_group[:2 if overlap else 1]))


# --- what glibc's malloc keeps resident beyond the live bytes (CPU runs) ---
# A CPU tensor comes from glibc's malloc. Blocks above its mmap threshold are mapped on their own and go back to
# the OS when freed; smaller ones come from the heap, whose freed pages stay resident for the next allocation.
# The threshold is dynamic: each freed mapped block raises it to that block's size, up to this ceiling
# (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), so after the first layer every transient up to 32 MiB is heap-served.
MMAP_CEILING = 32 << 20
# What oneDNN's prompt-pass GEMMs (kernels.dispatch.onednn_gemm) add to the peak RSS beyond torch's tensors: its
# JIT kernels, primitive cache and scratchpad, and the heap they leave: the peak RSS with
# FLEXGEN_H2O_CPU_GEMM=onednn minus =blas (`pytest tests/memory/test_preflight_rss.py -s`; docs/architecture.md,
# "The preflight's RAM figure").
ONEDNN_BYTES = 32 << 20
# The heap's free top goes back to the OS only beyond the trim threshold, which glibc keeps at twice the mmap
# threshold: up to twice the largest heap-served block freed so far stays resident. Each dummy tensor is
# gathered into an array of its own size (weights/dummy.py) and freed once placed, so after loading them the
# threshold is at least the largest one under the ceiling (at least 16 MiB counted: the older generator's scratch).
LOADER_SCRATCH = 16 << 20


@functools.lru_cache(maxsize=64)
def _dummy_scratch(model: ModelConfig) -> int:
    sizes = [2 * s.numel for s in all_specs(build_layers(model)) if 2 * s.numel < MMAP_CEILING]
    return max([LOADER_SCRATCH] + sizes)
# Heap holes: freed blocks between live ones, resident but reused only by blocks that fit. Not derivable from
# the shapes: measured as the peak RSS beyond every other term (docs/architecture.md, "The preflight's RAM
# figure"). With the threshold fixed (MALLOC_MMAP_THRESHOLD_=1048576) the heap serves no block over 1 MiB.
HEAP_HOLES_FRACTION = 0.17


def layer_transients(model: ModelConfig, rows: int, tokens: int, itemsize: int, score_block: int
                     ) -> tuple[list[int], dict[str, list[int]]]:
    """The tensors `ModelConfig.workspace_bytes` counts, one by one: the hidden state in and out (live through
    the layer), and each phase's intermediates (attention, MLP, head), of which that formula takes the largest."""
    h, f, d, g, nh = model.hidden_size, model.ffn_size, model.head_dim, model.n_kv_heads, model.n_heads
    bt = rows * tokens
    attn = [bt * nh * d * itemsize] * 2 + [bt * g * d * itemsize] * 2          # q and output; k and v
    if score_block:       # scored attention: the logits block and its copies, and the per-key score sums
        attn += [score_block] * 4 + [rows * g * tokens * 4]
    else:
        attn += [bt * nh * d * itemsize]
    mlp = [bt * f * itemsize] * (3 if model.activation == "silu" else 2)
    return [bt * h * itemsize] * 2, {"attention": attn, "mlp": mlp, "head": [rows * model.vocab_size * 4] * 2}


def _heap_served(sizes: list[int]) -> int:
    # strictly below: a request of exactly 32 MiB plus malloc's chunk header is over the ceiling, so mapped
    return sum(s for s in sizes if s < MMAP_CEILING)


def _kv_tensors(model: ModelConfig, seqs: int, capacity: int, fmt: StorageFormat) -> list[int]:
    """One cache part's tensors (KVCache: k, v, fp32 score, int32 position)."""
    slots = seqs * model.n_kv_heads * capacity
    return [fmt.nbytes(slots * model.head_dim)] * 2 + [slots * 4] * 2


def allocator_bytes(model: ModelConfig, rows: int, tokens: int, itemsize: int, score_block: int,
                    heap_live: int, *, loader_scratch: int = 0) -> dict[str, int]:
    """RAM glibc keeps resident beyond the live bytes of a prompt pass of `rows` x `tokens` (the peak phase).
    - "mmap split": the workspace formula takes the largest phase, as if the MLP's blocks reused the attention's
      pages. They do only when both are heap-served; when a phase's blocks exceed the ceiling (OPT-125M's MLP at
      4096 tokens: 2 x 48 MiB) they are fresh mappings while the attention's freed blocks stay in the heap, so
      the peak holds the largest heap-served phase plus the largest mapped one.
    - "heap top": the free top of the heap below glibc's trim threshold, twice the largest heap-served block
      (the layer's largest transient under the ceiling, or the dummy weights' scratch: `loader_scratch`).
    - "heap holes": HEAP_HOLES_FRACTION of the heap-served bytes live at that peak (heap_live: KV parts and
      resting activations in RAM, plus the layer's heap-served transients)."""
    hidden, phases = layer_transients(model, rows, tokens, itemsize, score_block)
    heap = {p: _heap_served(t) for p, t in phases.items()}
    mapped = {p: sum(t) - heap[p] for p, t in phases.items()}
    split = max(heap.values()) + max(mapped.values()) - max(sum(t) for t in phases.values())
    live = heap_live + _heap_served(hidden) + max(heap.values())
    largest = max([loader_scratch] + [x for t in [hidden, *phases.values()] for x in t if x < MMAP_CEILING])
    return {"mmap split": split, "heap top": 2 * largest, "heap holes": int(HEAP_HOLES_FRACTION * live)}
