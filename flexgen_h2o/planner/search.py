"""`--percent auto`: the placement, batch and compression with the highest predicted throughput that fits.

The space: weights and KV split across the tiers on FlexGen's grid (on a CPU the compute and host tiers are the
same RAM, so only the disk share of each is searched; resting activations stay on the compute tier except in the
all-on-disk last resort), the GPU batch size (powers of two up to the prompts, stopping at the first that does
not fit), the number of GPU batches, weight and KV compression (none, int8, int4) and, on a
GPU, attention where the KV lives. Every candidate is checked against every tier's capacity by the preflight's
own arithmetic (RAM, GPU memory, disk free; RAM with RAM_HEADROOM to spare) and ranked by cost.predict, a
compressed plan only ahead of an uncompressed one it beats by COMPRESSION_MARGIN. The eviction budget is the
user's: it changes the output, so it is never searched.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, replace
from typing import Any, Iterator

from flexgen_h2o.config import ConfigError, OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import ModelConfig
from flexgen_h2o.planner.cost import Prediction, page_cache_room, predict
from flexgen_h2o.planner.memory import estimate
from flexgen_h2o.planner.preflight import Check, Machine, checks

BITS = (None, 8, 4)
CPU_WEIGHT_DISK = tuple(range(0, 101, 10))        # % of weights on disk (FlexGen's grid), where compute and host
CPU_KV_DISK = (0, 25, 50, 75, 100)                # are one RAM; % of the KV on disk
GPU_GRID = (0, 20, 40, 60, 80, 100)               # FlexGen's grid, coarser: % on the GPU, then % in host memory
GPU_CACHE = ((100, 0), (50, 50), (0, 100), (0, 0))
NUM_GPU_BATCHES = (1, 2, 4, 8)
MAX_GPU_BATCH = 1024
# compression changes the output (a little): a compressed plan must be predicted this much faster to be chosen
# over an uncompressed one (the rates' own run-to-run noise is several %: SmolLM2's auto run chose int8 weights
# for a 0.2 % predicted gain before this)
COMPRESSION_MARGIN = 1.05
# a plan's predicted peak RSS must leave this share of the RAM free: measured peaks run a little over their
# prediction, and a plan at a memory limit's edge runs at its reclaim cliff (docs/planner.md, "Does it choose
# well?"). A given placement's preflight keeps no such margin: that is the user's call.
RAM_HEADROOM = 0.04


@dataclass
class Candidate:
    offload: OffloadPolicy
    prediction: Prediction
    checks: list[Check]


def _placements(device_type: str) -> Iterator[tuple[float, ...]]:
    if device_type == "cpu":
        for wd, cd in itertools.product(CPU_WEIGHT_DISK, CPU_KV_DISK):
            yield (100 - wd, 0, 100 - cd, 0, 100, 0)
        yield (0, 0, 0, 0, 0, 0)                    # everything on disk: the last resort of a tiny RAM
        return
    # weights on the whole grid; the KV whole on one tier or halved between GPU and host, activations on the GPU:
    # a coarser space than FlexGen's, to keep the search to seconds (not measured on a GPU yet)
    for w_gpu in GPU_GRID:
        for w_cpu in (g for g in GPU_GRID if w_gpu + g <= 100):
            for c_gpu, c_cpu in GPU_CACHE:
                yield (w_gpu, w_cpu, c_gpu, c_cpu, 100, 0)


def _batch_sizes(limit: int) -> list[int]:
    out, b = [], 1
    while b <= min(limit, MAX_GPU_BATCH):
        out.append(b)
        b *= 2
    return out


def search(model: ModelConfig, eviction: EvictionConfig, base: OffloadPolicy, rates: dict[str, Any], *,
           prompt_len: int, gen_len: int, n_prompts: int, device_type: str, machine: Machine,
           offload_root: str | os.PathLike | None = None, store_dir: str | os.PathLike | None = None,
           dummy_store_bytes: int = 0, real_weights: bool = False, compress: bool = True,
           keep: int = 10) -> list[Candidate]:
    """The `keep` best candidates that fit, best first (empty: nothing fits). `base` gives every field the search
    does not choose (KV dtype, overlap, group size, ...); n_prompts bounds the block."""
    c = 4 if device_type == "cpu" else 2
    found: list[Candidate] = []
    weight_bits = BITS if compress else (base.weight_bits,)
    kv_bits = BITS if compress else (base.kv_bits,)
    cpu_compute = (False, True) if device_type == "cuda" else (base.cpu_cache_compute,)
    for pct, wb, kb, ccc in itertools.product(_placements(device_type), weight_bits, kv_bits, cpu_compute):
        if ccc and pct[3] == 0:
            continue                             # attention where the KV lives only matters when it lives in RAM
        for ngb in NUM_GPU_BATCHES:
            gbs_list = _batch_sizes(max(1, n_prompts // ngb))
            if ngb > 1 and n_prompts < 2 * ngb:
                continue
            for gbs in gbs_list:
                off = replace(base.with_percent(pct), gpu_batch_size=gbs, num_gpu_batches=ngb, weight_bits=wb,
                              kv_bits=kb, cpu_cache_compute=ccc)
                try:
                    est = estimate(model, off, eviction, prompt_len=prompt_len, gen_len=gen_len,
                                   n_seqs=min(off.block_size, n_prompts), compute_dtype_bytes=c,
                                   dummy_store_bytes=dummy_store_bytes, device_type=device_type,
                                   real_weights=real_weights)
                except (ConfigError, ValueError):
                    break
                res = checks(est, machine, offload_root=offload_root, store_dir=store_dir)
                if not all(r.ok for r in res) or any(r.resource == "RAM" and r.need > (1 - RAM_HEADROOM) * r.available
                                                     for r in res):
                    break                        # a larger batch needs more of every tier
                pred = predict(est.plan, rates, n_prompts=n_prompts, free_ram=page_cache_room(res),
                               peak_bytes={r.resource: r.need for r in res})
                found.append(Candidate(off, pred, res))
    found.sort(key=lambda cand: -cand.prediction.total_tok_s / (
        COMPRESSION_MARGIN if cand.offload.weight_bits or cand.offload.kv_bits else 1.0))
    return found[:keep]


def tok_s(x: float) -> str:
    """A throughput for people: one decimal, or three significant digits below 10 (OPT-30B from disk: 0.0489)."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def describe(cand: Candidate) -> str:
    """One line: the flags of a candidate and its prediction."""
    off, p = cand.offload, cand.prediction
    flags = (f"--percent {' '.join(f'{x:g}' for x in off.percent)} --gpu-batch-size {off.gpu_batch_size} "
             f"--num-gpu-batches {off.num_gpu_batches}")
    if off.weight_bits:
        flags += f" --compress-weight {off.weight_bits}"
    if off.kv_bits:
        flags += f" --compress-cache {off.kv_bits}"
    if off.cpu_cache_compute:
        flags += " --cpu-cache-compute"
    need = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in p.peak_bytes.items())
    return (f"{flags}: predicted {tok_s(p.total_tok_s)} tok/s (prefill {p.prefill_s * p.blocks:.1f} s, decode "
            f"{p.decode_s * p.blocks:.1f} s; {p.limits.get('decode', '?')}-bound decode) | {need}")
