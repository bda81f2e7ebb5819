"""Preflight: compare a run's per-tier estimate with this machine before anything is loaded.

RAM comes from psutil (`available`: free plus reclaimable page cache) capped by a container's memory cgroup
(planner/cgroup.py), GPU memory from the backend, disk from
the file systems of the offload dir and of a dummy store about to be written. A run that does not fit is
refused with the numbers and the changes that would make it fit, so the OOM killer never gets a say.

The RAM figure is the process's predicted peak RSS, term by term (docs/architecture.md, "Memory accounting"):
what the process holds now (interpreter, torch, tokenizer: measured, not assumed), the code a run first touches,
the estimate's RAM parts, and what malloc keeps beyond them (`memory.allocator_bytes`). It is checked against
what the process could hold: `available` plus what it already holds.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from flexgen_h2o.config import ConfigError, OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import ModelConfig
from flexgen_h2o.planner.cgroup import cgroup_ram
from flexgen_h2o.planner.memory import PARTS, Estimate, estimate, plan_bytes
from flexgen_h2o.planner.plan import Plan

MIB = 1 << 20
GIB = 1 << 30
# Code and state a run maps after the preflight: the engine's modules, the compiled kernels' library, torch's
# CPU kernels for the ops a forward uses, its thread pool: the RSS after the first generate and malloc_trim, less
# the tiers' bytes (docs/architecture.md, "The preflight's RAM figure").
RUNTIME_BYTES = 32 * MIB
GPU_HEADROOM = 256 * MIB     # CUDA context and caching-allocator slack; on top of 5 % of the estimate
DISK_HEADROOM = 64 * MIB


class PreflightError(ConfigError):
    """The run does not fit this machine; the message holds the numbers and what to change."""


def ranks_per_node() -> int:
    """Ranks of this torchrun job on this node (LOCAL_WORLD_SIZE; 1 outside torchrun): they share its RAM and disk,
    so each rank's checks and plan count its share of what is free."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


@dataclass(frozen=True)
class Machine:
    ram_available: int                  # bytes the OS can give without swapping (psutil.available)
    ram_total: int
    device_free: int | None = None      # compute device bytes free (None: the compute tier is RAM)
    device_total: int | None = None
    process_rss: int = 0                # what this process holds now: in the prediction, and out of `available`

    @classmethod
    def probe(cls, backend=None) -> "Machine":
        """This machine as this process sees it: psutil's RAM, capped by a container's memory cgroup."""
        vm = psutil.virtual_memory()
        available, total = int(vm.available), int(vm.total)
        limited = cgroup_ram()
        if limited is not None:
            total, available = min(total, limited[0]), min(available, limited[1])
        total, available = total // ranks_per_node(), available // ranks_per_node()
        rss = psutil.Process().memory_info().rss
        if backend is None or not getattr(backend, "is_cuda", False):
            return cls(available, total, process_rss=rss)
        mem = backend.device_memory()
        # allocated-by-this-process only: other processes' use is not visible through the backend
        return cls(available, total, mem["total_bytes"] - mem["current_bytes"], mem["total_bytes"], process_rss=rss)


@dataclass
class Check:
    resource: str                        # "RAM", "GPU memory" or "disk (<path>)"
    need: int                            # RAM: the predicted peak RSS; else the estimate plus headroom
    available: int                       # RAM: psutil's available plus what the process holds now
    parts: dict[str, int]                # estimate by part (weights, kv, activations, workspace), then RAM's terms

    @property
    def ok(self) -> bool:
        return self.need <= self.available


def fmt(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _existing(path: Path) -> Path:
    """The nearest existing ancestor (the offload root may not exist yet)."""
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def checks(est: Estimate, machine: Machine, *, offload_root: str | os.PathLike | None = None,
           store_dir: str | os.PathLike | None = None, parts: tuple[str, ...] = PARTS) -> list[Check]:
    """One Check per resource the run uses. `parts` limits what is counted (the API checks KV and activations
    again at generate time, after the weights are placed: they are then in the process's RSS)."""
    def of(tier: str) -> dict[str, int]:
        return {p: v for p, v in est.bytes[tier].items() if p in parts and v}

    out: list[Check] = []
    compute, host = of("compute"), of("host")
    if machine.device_free is None:      # CPU: the compute tier is a pool in RAM, like the host tier
        ram = {p: compute.get(p, 0) + host.get(p, 0) for p in PARTS if compute.get(p, 0) + host.get(p, 0)}
        ram.update(est.beyond_tiers)     # malloc's slack, the last caches; on a GPU those are device memory
    else:
        gpu = sum(compute.values())
        # the headroom is a listed term, so the need is the sum of the terms shown
        out.append(Check("GPU memory", _with_headroom(gpu), machine.device_free,
                         {**compute, "headroom": _with_headroom(gpu) - gpu} if gpu else compute))
        ram = dict(host)
    # the peak RSS: the run's own bytes, the code it maps, and what the process holds now
    ram.update({"runtime": RUNTIME_BYTES, "process now": machine.process_rss})
    out.append(Check("RAM", sum(ram.values()), machine.ram_available + machine.process_rss,
                     {p: v for p, v in ram.items() if v}))
    # disk: offload-dir files (KV, activations) and a dummy store being written, grouped by file system
    disk = of("disk")
    where: dict[int, tuple[Path, dict[str, int]]] = {}
    spill = {p: v for p, v in disk.items() if p != "weights"}
    for path, need in ((offload_root, spill), (store_dir, {"weights": disk.get("weights", 0)})):
        if path is None or not sum(need.values()):
            continue
        root = _existing(Path(path))
        dev = root.stat().st_dev
        prev = where.setdefault(dev, (root, {}))[1]
        for p, v in need.items():
            prev[p] = prev.get(p, 0) + v
    for root, need in where.values():
        out.append(Check(f"disk ({root})", sum(need.values()) + DISK_HEADROOM,
                         shutil.disk_usage(root).free // ranks_per_node(), {**need, "headroom": DISK_HEADROOM}))
    return out


def _with_headroom(n: int) -> int:
    return int(n * 1.05) + GPU_HEADROOM if n else 0


def report(est: Estimate, results: list[Check]) -> str:
    """The estimate per resource: need (with headroom) against what the machine has, and the breakdown."""
    lines = []
    for c in results:
        parts = ", ".join(f"{p} {fmt(v)}" for p, v in c.parts.items()) or "nothing"
        verdict = "ok" if c.ok else "DOES NOT FIT"
        lines.append(f"  {c.resource}: need {fmt(c.need)} of {fmt(c.available)} available  [{parts}]  {verdict}")
    return "\n".join(lines)


def summary_line(results: list[Check]) -> str:
    n = ranks_per_node()
    share = f" (per rank: 1/{n} of this node's RAM and disk)" if n > 1 else ""
    return f"preflight{share}: " + " | ".join(f"{c.resource} {fmt(c.need)} of {fmt(c.available)}" for c in results)


# --- what to change ---

def _percent_args(p: OffloadPolicy) -> str:
    return "--percent " + " ".join(f"{x:g}" for x in p.percent)


def _candidates(offload: OffloadPolicy, eviction: EvictionConfig) -> list[tuple[str, OffloadPolicy, EvictionConfig]]:
    """Single changes a user can make with one flag, most useful first."""
    w_gpu, w_cpu, c_gpu, c_cpu, a_gpu, a_cpu = offload.percent
    out = []
    if eviction.policy == "full":
        out.append(("--hh-ratio 0.1 (H2O: 10 % heavy hitters + 10 % recent)", offload,
                    EvictionConfig(policy="h2o", hh_ratio=0.1, position_rolling=eviction.position_rolling)))
    moves = [
        ("weights from the compute tier to host memory", (0, w_cpu + w_gpu, c_gpu, c_cpu, a_gpu, a_cpu)),
        ("KV cache from the compute tier to host memory", (w_gpu, w_cpu, 0, c_cpu + c_gpu, a_gpu, a_cpu)),
        ("weights streamed from disk", (w_gpu, 0, c_gpu, c_cpu, a_gpu, a_cpu)),
        ("all weights streamed from disk", (0, 0, c_gpu, c_cpu, a_gpu, a_cpu)),
        ("KV cache on disk", (w_gpu, w_cpu, 0, 0, a_gpu, a_cpu)),
        ("KV cache from disk to host memory", (w_gpu, w_cpu, c_gpu, 100 - c_gpu, a_gpu, a_cpu)),
    ]
    for what, pct in moves:
        if tuple(pct) != offload.percent:
            new = offload.with_percent(pct)
            out.append((f"{_percent_args(new)} ({what})", new, eviction))
    gbs = offload.gpu_batch_size
    while gbs > 1:
        gbs //= 2
        out.append((f"--gpu-batch-size {gbs} (block {gbs * offload.num_gpu_batches})",
                    replace(offload, gpu_batch_size=gbs), eviction))
    return out


def suggest(model: ModelConfig, offload: OffloadPolicy, eviction: EvictionConfig, machine: Machine,
            limit: int = 3, **kw) -> list[str]:
    """Up to `limit` one-flag changes whose estimate fits this machine (kw: estimate() and checks() args)."""
    est_kw = {k: v for k, v in kw.items() if k in ("prompt_len", "gen_len", "n_seqs", "compute_dtype_bytes",
                                                   "dummy_store_bytes", "real_weights")}
    chk_kw = {k: v for k, v in kw.items() if k in ("offload_root", "store_dir")}
    found = []
    for text, off, ev in _candidates(offload, eviction):
        try:
            est = estimate(model, off, ev, **est_kw)
        except ValueError:
            continue
        results = checks(est, machine, **chk_kw)
        if all(c.ok for c in results):
            found.append(f"{text}: {summary_line(results).removeprefix('preflight: ')}")
        if len(found) >= limit:
            break
    return found


def preflight(model: ModelConfig, offload: OffloadPolicy, eviction: EvictionConfig, *, prompt_len: int | None = None,
              gen_len: int | None = None, n_seqs: int | None = None, backend=None,
              offload_root: str | os.PathLike | None = None, store_dir: str | os.PathLike | None = None,
              dummy_store_bytes: int = 0, real_weights: bool = False, machine: Machine | None = None,
              parts: tuple[str, ...] = PARTS, plan: Plan | None = None) -> tuple[Estimate, list[Check]]:
    """Estimate and check; raises PreflightError (numbers and suggestions) when any resource is short. plan: the
    job's peak Plan (planner/job.JobPlan.peak), counted as it is; else a block of the given shape is planned."""
    c = 2 if backend is not None and getattr(backend, "is_cuda", False) else 4
    if plan is not None:
        prompt_len, gen_len, n_seqs, c = plan.prompt_len, plan.gen_len, plan.n_seqs, plan.compute_itemsize
    kw = dict(prompt_len=prompt_len, gen_len=gen_len, n_seqs=n_seqs, compute_dtype_bytes=c,
              dummy_store_bytes=dummy_store_bytes, real_weights=real_weights)
    est = (plan_bytes(plan, dummy_store_bytes=dummy_store_bytes, real_weights=real_weights) if plan is not None
           else estimate(model, offload, eviction, **kw))
    machine = machine or Machine.probe(backend)
    results = checks(est, machine, offload_root=offload_root, store_dir=store_dir, parts=parts)
    if all(r.ok for r in results):
        return est, results
    short = [r.resource for r in results if not r.ok]
    lines = [f"preflight: {model.name} does not fit this machine ({', '.join(short)}): block {est.n_seqs} "
             f"(gpu batch {offload.gpu_batch_size} x {offload.num_gpu_batches}), prompt {prompt_len} + gen "
             f"{gen_len}, {_percent_args(offload)}, KV {eviction.policy} ({fmt(est.kv_bytes)}; full cache "
             f"{fmt(est.full_kv_bytes)})", report(est, results)]
    if parts == PARTS:
        tips = suggest(model, offload, eviction, machine, offload_root=offload_root, store_dir=store_dir, **kw)
        lines.append("what to change (each alone fits):" if tips else
                     "no single change fits; combine a smaller block, H2O (--hh-ratio) and disk placement")
        lines += [f"  {t}" for t in tips]
    raise PreflightError("\n".join(lines))
