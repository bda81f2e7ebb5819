"""This machine's rates for the cost model (planner/cost.py), measured once and cached with the machine's identity.

Each rate is the engine's own code path timed on synthetic shapes, not a vendor peak:
- linear: `Kernels.linear` (the compiled fp16 and int4/int8 kernels for a decode step's rows, oneDNN or MKL for a
  prompt's) at several row counts, against weights rotated among more bytes than the last-level cache holds, so a
  decode step's weights stream from DRAM as they do in a run;
- decode attention: `Kernels.narrow_decode_attention` over fp16 and quantized windows, seconds per slot read;
- prompt attention: the scored (H2O) and plain prompt attention, FLOP/s;
- memory read, disk write (fsync'd) and cold read (page cache dropped), page-cache read, on the offload folder's
  file system; host<->device copies and device rates where there is a GPU;
- fixed cost: a tiny model's decode step through the real engine, per schedule layer and GPU batch (the Python,
  dispatch and small-op time no byte or FLOP count sees).

`rates()` returns the cached constants for this machine, measuring them when there are none or `refresh` is
asked for (`--calibrate`; `docs/planner.md` "The machine's rates"). The identity: CPU model, cores, threads,
torch version, whether the compiled kernels load, GPU name, and the offload folder's file system.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

if __name__ == "__main__":       # an entry point: spin-waiting OpenMP threads would distort every rate
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flexgen_h2o import model_probe  # noqa: E402
from flexgen_h2o.backend import get_backend  # noqa: E402
from flexgen_h2o.config import GenerationConfig, OffloadPolicy  # noqa: E402
from flexgen_h2o.engine import Engine  # noqa: E402
from flexgen_h2o.formats import storage_format  # noqa: E402
from flexgen_h2o.kernels import build, resolve  # noqa: E402
from flexgen_h2o.kv import EvictionConfig  # noqa: E402
from flexgen_h2o.memory.tier import drop_file_cache  # noqa: E402
from flexgen_h2o.models import PRESETS, all_specs, build_layers, ops, resolve_model, schedule_groups  # noqa: E402
from flexgen_h2o.planner.cost import PROBE_ROWS, probe_key  # noqa: E402
from flexgen_h2o.planner.preflight import Machine, PreflightError  # noqa: E402
from flexgen_h2o.planner.search import search  # noqa: E402
from flexgen_h2o.weights import store_root  # noqa: E402

ROWS = (1, 4, 16, 64, 256, 1024)          # linear rows measured: decode steps to prompt chunks
LINEAR_K, LINEAR_N = 1024, 2816           # one weight matrix: 5.5 MiB in fp16
DISK_PROBE_BYTES = 256 << 20
WEIGHT_FORMATS = ("fp16", "int8-g64", "int4-g64")
VERSION = 2                               # bump when what is measured changes: older caches are measured again


def best_time(fn: Callable[[], Any], min_s: float, sync: Callable[[], None] = lambda: None) -> float:
    """Best single-call time over calls lasting at least min_s in all (the first call, a warm-up, discarded)."""
    fn()
    sync()
    best, spent = math.inf, 0.0
    while spent < min_s or best == math.inf:
        t0 = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


def _weights(fmt_name: str, device: torch.device) -> list[Any]:
    """Weight matrices in a storage format as the engine stages them: fp16 tensors or PackedMatrix rows."""
    n = max(2, model_probe.LLC_BYTES // storage_format(fmt_name).nbytes(LINEAR_K * LINEAR_N, LINEAR_K) + 1)
    seeded = (torch.Generator().manual_seed(i) for i in range(n))
    return [model_probe.packed_weight(torch.randn(LINEAR_N, LINEAR_K, generator=g) * 0.02, fmt_name, device)
            for g in seeded]


def measure_linear(kernels: Any, device: torch.device, dtype: torch.dtype, sync: Callable[[], None],
                   min_s: float) -> dict[str, dict[str, float]]:
    """GFLOP/s of Kernels.linear per weight format and row count."""
    out: dict[str, dict[str, float]] = {}
    for name in WEIGHT_FORMATS:
        mats = _weights(name, device)
        out[name] = {}
        for rows in ROWS:
            x = torch.randn(rows, LINEAR_K, device=device, dtype=dtype)
            it = iter(range(1 << 62))
            t = best_time(lambda: kernels.linear(x, mats[next(it) % len(mats)]), min_s, sync)
            out[name][str(rows)] = 2 * rows * LINEAR_K * LINEAR_N / t / 1e9
    return out


def measure_attention(kernels: Any, device: torch.device, dtype: torch.dtype, sync: Callable[[], None],
                      min_s: float) -> dict[str, float]:
    """Decode attention: nanoseconds per (sequence, KV head, slot) read, per KV format; prompt attention: GFLOP/s
    of the scored (H2O) and plain paths at a 1,024-token prompt."""
    b, h, g, s, d = 32, 12, 4, 512, 64
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, 1, d, generator=gen).to(device, dtype)
    valid = torch.ones(b, g, s, dtype=torch.bool, device=device)
    slot = torch.zeros(b, g, dtype=torch.long, device=device)
    k_new, v_new = (torch.randn(b, g, 1, d, generator=gen).to(device, dtype) for _ in range(2))
    out: dict[str, float] = {}
    for name in ("fp16", "int8-g64", "int4-g64"):
        fmt = storage_format(name)
        raw = torch.randn(2, b, g, s, d, generator=gen)
        k, v = (fmt.pack(raw[i]).to(device) for i in range(2))
        if not fmt.quantized and device.type != "cpu":
            k, v = k.to(dtype), v.to(dtype)
        t = best_time(lambda: kernels.narrow_decode_attention(q, k, v, valid, slot, k_new, v_new, 0.125,
                                                          want_scores=True, fmt=fmt), min_s, sync)
        out[f"decode_ns_per_slot_{name}"] = t / (b * g * s) * 1e9
    n = 1024
    qp, kp, vp = (torch.randn(1, hh, n, d, generator=gen).to(device, dtype) for hh in (h, g, g))
    tv = torch.ones(1, n, dtype=torch.bool, device=device)
    flops = 2 * 2 * h * d * n * n / 2                          # QK^T and PV, causal half
    t = best_time(lambda: kernels.scored_prompt_attention(qp, kp, vp, tv, True, 0.125, "sum", 256), min_s, sync)
    out["prompt_scored_GFLOPs"] = flops / t / 1e9
    mask = ops.causal_pad_mask(tv)
    t = best_time(lambda: ops.grouped_attention(qp, kp, vp, mask, 0.125, causal_only=True), min_s, sync)
    out["prompt_plain_GFLOPs"] = flops / t / 1e9
    return out


def measure_memory(min_s: float, nbytes: int = 256 << 20) -> dict[str, float]:
    """Read (a sum) and copy (read + write counted) bandwidth over `nbytes` of fp32."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return {"mem_read_GBps": src.nbytes / best_time(lambda: src.sum(), min_s) / 1e9,
            "memcpy_GBps": 2 * src.nbytes / best_time(lambda: dst.copy_(src), min_s) / 1e9}


def measure_disk(folder: Path, nbytes: int = DISK_PROBE_BYTES) -> dict[str, float]:
    """Sequential write with fsync, the page cache dropped, a cold read, then the same read from the page cache."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"calibrate-{os.getpid()}.bin"
    chunk = os.urandom(8 << 20)
    try:
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for _ in range(nbytes // len(chunk)):
                f.write(chunk)
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        drop_file_cache(path)
        buf = memoryview(bytearray(16 << 20))

        def read() -> float:
            t0 = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf) > 0:
                    pass
            return time.perf_counter() - t0
        cold, warm = read(), read()
    finally:
        path.unlink(missing_ok=True)
    return {"disk_write_GBps": nbytes / write_s / 1e9, "disk_read_GBps": nbytes / cold / 1e9,
            "page_cache_read_GBps": nbytes / warm / 1e9}


def measure_fixed(device: str, repeats: int = 3) -> dict[str, float]:
    """Seconds a decode step and a prompt pass cost per schedule layer and GPU batch beyond their bytes and FLOPs:
    a 4-layer model 64 wide through the real engine, one sequence; the best of `repeats` runs of 32 steps."""
    cfg = PRESETS["smollm2-135m"].replace(name="calibrate-tiny", n_layers=4, hidden_size=64, n_heads=4,
                                          n_kv_heads=2, head_dim=16, ffn_size=128, vocab_size=256)
    rng = np.random.default_rng(0)
    arrays = {s.name: (rng.standard_normal(s.shape) * 0.02).astype(np.float16) for s in all_specs(build_layers(cfg))}
    engine = Engine(cfg, arrays.__getitem__, offload=OffloadPolicy(gpu_batch_size=1), device=device)
    prompt, steps = [[5] * 32], 33
    engine.generate(prompt, GenerationConfig(max_new_tokens=4))
    best = {"prefill_s": math.inf, "decode_s": math.inf}
    for _ in range(repeats):
        m = engine.generate(prompt, GenerationConfig(max_new_tokens=steps)).metrics
        best = {k: min(best[k], m[k]) for k in best}
    groups = len(schedule_groups([layer.kind for layer in build_layers(cfg)], True))
    return {"fixed_decode_s_per_layer": best["decode_s"] / (steps - 1) / groups,
            "fixed_prefill_s_per_layer": best["prefill_s"] / groups}


def measure_gpu(backend: Any, min_s: float) -> dict[str, float] | None:
    """Pinned host<->device copies and a device-to-device copy through the backend (None: no GPU)."""
    if not backend.is_cuda:
        return None
    n = 512 << 20
    dev_t = backend.compute_device
    host = backend.empty_pinned((n,), torch.uint8)
    dev = torch.empty(n, dtype=torch.uint8, device=dev_t)
    other = torch.empty_like(dev)
    sync = backend.synchronize
    return {"name": backend.device_name(),
            "h2d_GBps": n / best_time(lambda: dev.copy_(host, non_blocking=True), min_s, sync) / 1e9,
            "d2h_GBps": n / best_time(lambda: host.copy_(dev, non_blocking=True), min_s, sync) / 1e9,
            "device_read_GBps": 2 * n / best_time(lambda: other.copy_(dev), min_s, sync) / 1e9}


def identity(offload_root: Path) -> dict[str, Any]:
    root = offload_root.expanduser().absolute()
    while not root.exists() and root != root.parent:
        root = root.parent
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "kernels": build.load() is not None,
            "gpu": get_backend().device_name(),
            "disk": os.stat(root).st_dev, "version": VERSION}


def measure(offload_root: Path, smoke: bool = False) -> dict[str, Any]:
    """Every rate of this machine (smoke: shorter timings, for tests)."""
    t0 = time.perf_counter()
    min_s = 0.02 if smoke else 0.15
    kernels = resolve()
    cpu = torch.device("cpu")
    res: dict[str, Any] = {"identity": identity(offload_root), "date": time.strftime("%Y-%m-%d %H:%M")}
    res["linear_GFLOPs"] = measure_linear(kernels, cpu, torch.float32, lambda: None, min_s)
    res.update(measure_attention(kernels, cpu, torch.float32, lambda: None, min_s))
    res.update(measure_memory(min_s))
    res.update(measure_disk(offload_root, (32 << 20) if smoke else DISK_PROBE_BYTES))
    res.update(measure_fixed("cpu"))
    backend = get_backend()
    gpu = measure_gpu(backend, min_s)
    if gpu is not None:
        dev, sync = backend.compute_device, backend.synchronize
        gpu["linear_GFLOPs"] = measure_linear(resolve(load=False), dev, torch.float16, sync, min_s)
        gpu.update(measure_attention(resolve(load=False), dev, torch.float16, sync, min_s))
        gpu.update(measure_fixed(str(dev)))
    res["gpu"] = gpu
    res["measure_s"] = time.perf_counter() - t0
    return res


def cache_path(offload_root: Path) -> Path:
    key = hashlib.sha1(json.dumps(identity(offload_root), sort_keys=True).encode()).hexdigest()[:12]
    return store_root() / "machine" / f"rates-{key}.json"


def cached(offload_root: Path) -> dict[str, Any] | None:
    """This machine's cached rates, or None (none yet, or a torn file)."""
    try:
        return json.loads(cache_path(offload_root).read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, res: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, path)


def rates(offload_root: Path, *, refresh: bool = False, smoke: bool = False, say: Callable[[str], None] = print,
          model: Any = None, formats: tuple[str, ...] = WEIGHT_FORMATS) -> dict[str, Any]:
    """This machine's rates: cached ones, or measured now (and cached) when there are none or refresh is set.
    model: a ModelConfig timed itself too (add_model: once per shape and weight format, then cached)."""
    path = cache_path(offload_root)
    path.parent.mkdir(parents=True, exist_ok=True)
    # one process measures at a time (the cache's folder flock'd): torchrun's ranks on one node would otherwise
    # time each other's load, and the ones that wait then read what the first one measured
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        res = None if refresh else cached(offload_root)
        if res is None:
            say(f"calibrating this machine's rates for the cost model (once; cached in {path}) ...")
            res = measure(offload_root, smoke)
            _write(path, res)
            say(f"calibrated in {res['measure_s']:.0f} s")
        if model is not None and add_model(res, model, formats, smoke, say):
            _write(path, res)
    finally:
        os.close(folder)                  # and with it the lock
    return res


def add_model(res: dict[str, Any], model: Any, formats: tuple[str, ...], smoke: bool = False,
              say: Callable[[str], None] = print) -> bool:
    """Time `model` itself in each weight format not timed yet (model_probe.py: its matrices, and a block's decode
    step through the engine), into res, on the GPU too when there is one; True when something was measured."""
    min_s = 0.02 if smoke else 0.15
    rows = PROBE_ROWS[:3] if smoke else PROBE_ROWS
    sides = [(res, resolve(), torch.device("cpu"), torch.float32, lambda: None)]
    if res.get("gpu"):
        backend = get_backend()
        sides.append((res["gpu"], resolve(load=False), backend.compute_device, torch.float16, backend.synchronize))
    did, ram = False, Machine.probe().ram_available
    for side, kernels, device, dtype, sync in sides:
        matrices = side.setdefault("model_linear_GFLOPs", {})
        blocks = side.setdefault("model_block", {})
        for name in formats:
            key = probe_key(model, name)
            if key in matrices and key in blocks:
                continue
            if not did:
                say(f"timing {model.name} itself for the cost model (once per shape and weight format; cached) ...")
            did = True
            matrices[key] = model_probe.measure_matrices(model, name, kernels, device, dtype, sync, min_s)
            # a model whose probe copies (model_probe.fits) exceed half the RAM is priced from the machine rates
            blocks[key] = (model_probe.measure_block(model, name, rows, str(device), say)
                           if model_probe.fits(model, name, ram) else {})
    return did


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


# the vector extensions that decide which kernels a CPU runs fast, as /proc/cpuinfo spells them
ISA_NAMES = (("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("avx_vnni", "AVX-VNNI"), ("avx512f", "AVX-512"),
             ("avx512_vnni", "AVX512-VNNI"), ("avx512_bf16", "AVX512_BF16"), ("amx_bf16", "AMX-BF16"),
             ("amx_int8", "AMX-INT8"))


def cpu_isa() -> str:
    """This CPU's vector extensions among ISA_NAMES, e.g. "AVX2 FMA F16C" ("unknown" without /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(name for flag, name in ISA_NAMES if flag in flags) or "no AVX2"


def auto_offload(model: Any, *, prompt_len: int, gen_len: int, n_prompts: int, eviction: Any = None,
                 device: str | None = None, offload_dir: str = "~/flexgen_offload_dir", base: Any = None,
                 calibrate: bool = False) -> tuple[Any, Any]:
    """(OffloadPolicy, Prediction): the best plan the search finds for this job on this machine."""
    cfg = resolve_model(model) if isinstance(model, str) else model
    backend = get_backend(device)
    root = Path(os.path.expanduser(offload_dir))
    measured = rates(root, refresh=calibrate, say=lambda s: None, model=cfg)
    found = search(cfg, eviction or EvictionConfig(policy="full"), base or OffloadPolicy(), measured,
                   prompt_len=prompt_len, gen_len=gen_len, n_prompts=n_prompts,
                   device_type="cuda" if backend.is_cuda else "cpu", machine=Machine.probe(backend), offload_root=root,
                   keep=1)
    if not found:
        raise PreflightError(f"{cfg.name} fits no placement the search tries for {n_prompts} prompt(s) of "
                             f"{prompt_len} + {gen_len} tokens on this machine")
    return found[0].offload, found[0].prediction


def main(argv: list[str] | None = None) -> int:
    """`python -m flexgen_h2o.calibrate [--offload-dir D]`: measure this machine's rates again and cache them."""
    p = argparse.ArgumentParser(prog="python -m flexgen_h2o.calibrate", description=main.__doc__)
    p.add_argument("--offload-dir", default="~/flexgen_offload_dir",
                   help="the disk tier's folder (its file system is measured)")
    a = p.parse_args(argv)
    res = rates(Path(os.path.expanduser(a.offload_dir)), refresh=True)
    print(json.dumps({k: v for k, v in res.items() if k != "identity"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
