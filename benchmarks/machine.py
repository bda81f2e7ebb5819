"""This machine's constants, measured the same day as the suite, and the roofline bound of one run.

    python -m benchmarks.machine --json machine.json [--smoke] [--disk-dir DIR]

Measured (each best-of-N, on the suite's thread count):
- fp32 GEMM FLOP/s at decode shapes (M = 1..128 rows against a weight matrix larger than the last-level cache,
  rotated among several, so the weights stream from DRAM as in a decode step) and at a prefill shape (M = 2048);
- memory copy bandwidth (read + write counted) and read bandwidth (a sum over a large tensor);
- disk write (fsync included) and cold read bandwidth of a scratch file on the stores' file system, the page
  cache dropped in between with posix_fadvise(DONTNEED) (no root); /proc/self/io says how much of the read
  really came from the device; then the same read from the page cache, and MemAvailable;
- host<->device copy bandwidth (pinned) when there is a CUDA GPU.

The bound of a run (`bound`) is FlexGen's cost model reduced to two terms per phase, perfectly overlapped:
bytes that must move (weights not resident, from their home tier, plus the KV kept, read once per step, plus on
a CPU the resident weights streamed from DRAM) over their bandwidth, against FLOPs over the peak GEMM rate.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # spin-waiting threads would distort the rates

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from flexgen_h2o.calibrate import best_time, cpu_isa, cpu_model  # noqa: E402

DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def measure_gemm(threads: int, smoke: bool) -> dict[str, Any]:
    import torch
    torch.set_num_threads(threads)
    k, n = (1024, 2048) if smoke else (2048, 4096)
    mats = [torch.randn(k, n) for _ in range(2 if smoke else 4)]     # 32 MiB each: out of the LLC in rotation
    min_s = 0.05 if smoke else 0.4
    decode: dict[str, float] = {}
    for m in DECODE_ROWS:
        x = torch.randn(m, k)
        it = iter(range(1 << 62))
        t = best_time(lambda: x @ mats[next(it) % len(mats)], min_s)
        decode[str(m)] = 2 * m * k * n / t / 1e9
    pm = 512 if smoke else 2048
    a, b = torch.randn(pm, k), torch.randn(k, k)
    prefill = 2 * pm * k * k / best_time(lambda: a @ b, min_s) / 1e9
    return {"gemm_decode_GFLOPs": decode, "gemm_prefill_GFLOPs": prefill, "gemm_shape_kn": [k, n],
            "gemm_prefill_rows": pm}


def measure_memory(threads: int, smoke: bool) -> dict[str, float]:
    import torch

    from flexgen_h2o.calibrate import measure_memory as probe
    torch.set_num_threads(threads)
    return probe(0.05 if smoke else 0.4, (64 if smoke else 256) << 20)


def proc_read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return -1


def measure_disk(folder: Path, size_mb: int) -> dict[str, float]:
    """Sequential write (fsync included), drop the file's page cache, sequential read back."""
    from benchmarks.common import drop_page_cache
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"disk_probe_{os.getpid()}.bin"
    chunk = os.urandom(8 << 20)                          # incompressible, in case the device compresses
    n_chunks = max(1, size_mb // 8)
    try:
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for _ in range(n_chunks):
                os.write(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - t0
        nbytes = n_chunks * len(chunk)
        drop_page_cache([path])
        buf = memoryview(bytearray(16 << 20))
        io0, t0, got_total = proc_read_bytes(), time.perf_counter(), 0
        with open(path, "rb", buffering=0) as f:
            while (got := f.readinto(buf)) > 0:
                got_total += got
        read_s = time.perf_counter() - t0
        io = proc_read_bytes() - io0 if io0 >= 0 else -1
        t0 = time.perf_counter()                         # again, now from the page cache the first read filled
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf) > 0:
                pass
        warm_s = time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)
    return {"disk_write_GBps": nbytes / write_s / 1e9, "disk_read_GBps": got_total / read_s / 1e9,
            "page_cache_read_GBps": got_total / warm_s / 1e9, "disk_probe_bytes": nbytes,
            "disk_read_cold_fraction": io / got_total if io >= 0 else -1.0, "mem_available_bytes": _mem_available()}


def _mem_available() -> int:
    """MemAvailable: how much the page cache can hold without evicting anything the processes need."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0


def measure_gpu(smoke: bool) -> dict[str, Any] | None:
    """The GPU side of the roofline: pinned host<->device copies, a device copy, an fp16 GEMM (None: no GPU)."""
    import torch
    if not torch.cuda.is_available():
        return None
    n = (64 if smoke else 512) << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    sync = torch.cuda.synchronize
    h2d = best_time(lambda: dev.copy_(host, non_blocking=True), 0.2, sync)
    d2h = best_time(lambda: host.copy_(dev, non_blocking=True), 0.2, sync)
    other = torch.empty_like(dev)
    d2d = best_time(lambda: other.copy_(dev), 0.2, sync)
    # the compute side of a GPU roofline: an fp16 GEMM at a prefill-like shape (the engine computes in fp16)
    m = 2048 if smoke else 8192
    a, b = (torch.randn(m, m, dtype=torch.float16, device="cuda") for _ in range(2))
    gemm = best_time(lambda: a @ b, 0.2, sync)
    return {"name": torch.cuda.get_device_name(0), "h2d_GBps": n / h2d / 1e9, "d2h_GBps": n / d2h / 1e9,
            "device_read_GBps": n / d2d / 1e9, "gemm_fp16_TFLOPs": 2 * m ** 3 / gemm / 1e12,
            "memory_bytes": torch.cuda.get_device_properties(0).total_memory}


def measure(threads: int = 2, smoke: bool = False, disk_dir: Path | None = None) -> dict[str, Any]:
    import torch
    from flexgen_h2o.weights import store_root
    t0 = time.perf_counter()
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(), "host": platform.node(),
                           "cpu": cpu_model(), "isa": cpu_isa(), "cpus": os.cpu_count(), "threads": threads,
                           "torch": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    res.update(measure_gemm(threads, smoke))
    res.update(measure_memory(threads, smoke))
    res.update(measure_disk(disk_dir or store_root() / "suite-scratch", 64 if smoke else 1024))
    res["gpu"] = measure_gpu(smoke)
    res["measure_s"] = time.perf_counter() - t0
    return res


# --- the roofline (pure arithmetic) ---

def peak_flops(machine: dict[str, Any]) -> float:
    """The best GEMM rate measured: the GPU's fp16 one where there is a GPU, else the CPU's best fp32 rate at any
    shape (the prefill shape in practice), in FLOP/s."""
    if machine.get("gpu"):
        return machine["gpu"]["gemm_fp16_TFLOPs"] * 1e12
    return max([machine["gemm_prefill_GFLOPs"], *machine["gemm_decode_GFLOPs"].values()]) * 1e9


def model_flops(cfg: Any, batch: int, prompt_len: int, kv_tokens: float) -> tuple[float, float]:
    """(prefill FLOPs, FLOPs of one decode step) for `batch` sequences: 2 per weight per token in the layers'
    matmuls; causal attention (QK^T and PV) 2*s^2*width per layer at prefill, 4*kv_tokens*width per token at
    decode; the LM head on the last position only (every system computes one position's logits per step)."""
    h, d, layers = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_layers
    kv_w = cfg.n_kv_heads * cfg.head_dim
    per_tok = layers * (h * (2 * d + 2 * kv_w) + (3 if cfg.activation == "silu" else 2) * h * cfg.ffn_size)
    head = cfg.vocab_size * cfg.embed_dim
    prefill = batch * (2 * prompt_len * per_tok + 2 * prompt_len ** 2 * d * layers + 2 * head)
    step = batch * (2 * per_tok + 2 * head + 4 * kv_tokens * d * layers)
    return float(prefill), float(step)


def bound(machine: dict[str, Any], cfg: Any, *, batch: int, prompt_len: int, gen_len: int,
          kv_read_bytes_per_seq: float, offloaded_weight_bytes: float, resident_weight_bytes: float,
          kv_tokens: float, page_cache: bool = True, host_weight_bytes: float = 0.0) -> dict[str, Any]:
    """The fastest this run could be on this machine: per phase max(bytes that must move / bandwidth,
    FLOPs / peak GEMM rate), i.e. transfers and compute perfectly overlapped.
    - bytes, prefill: one pass of the offloaded (disk-homed) weights at the cold disk read rate;
    - bytes, decode step: the offloaded weights again (from the page cache when they fit the free RAM, else
      from disk), plus every sequence's kept KV read once from RAM, plus,
      when the compute device is the CPU, the resident weights streamed once from DRAM (a decode GEMM has too
      few rows to reuse them from cache: the decode-height GEMM rates in machine.json show it);
    kv_read_bytes_per_seq and kv_tokens are averages over the decode steps; page_cache=False: the run drops the
    weights from the page cache after every read, so every pass is bounded by the disk.
    With a GPU: the peak is its fp16 GEMM rate, the weights homed in host RAM (host_weight_bytes) cross the
    host->device link once per pass, and the kept KV is read from device memory, beside the link."""
    disk = machine["disk_read_GBps"] * 1e9
    mem = machine["mem_read_GBps"] * 1e9
    # after the first (cold) pass, offloaded weights that fit the free RAM come back from the page cache: the
    # physical limit of the later passes on this machine is the page-cache read rate, not the disk's
    cached = (page_cache and offloaded_weight_bytes <= machine.get("mem_available_bytes", 0)
              and "page_cache_read_GBps" in machine)
    again = machine["page_cache_read_GBps"] * 1e9 if cached else disk
    peak = peak_flops(machine)
    gpu = machine.get("gpu")
    dram_weights = resident_weight_bytes if gpu is None else 0.0
    link = host_weight_bytes / (gpu["h2d_GBps"] * 1e9) if gpu else 0.0
    kv_mem = gpu["device_read_GBps"] * 1e9 if gpu else mem
    f_pre, f_step = model_flops(cfg, batch, prompt_len, kv_tokens)
    t_pre = {"compute": f_pre / peak, "io": offloaded_weight_bytes / disk + link}
    kv_s = batch * kv_read_bytes_per_seq / kv_mem
    t_step = {"compute": f_step / peak, "io": offloaded_weight_bytes / again + link + dram_weights / mem}
    if gpu:         # the link and the device's memory are separate resources: their transfers overlap
        t_step["device memory"] = kv_s
    else:           # on a CPU the KV and the streamed weights come through the same DRAM
        t_step["io"] += kv_s
    pre_s, step_s = max(t_pre.values()), max(t_step.values())
    dec_s = step_s * max(gen_len - 1, 0)
    return {"prefill_s": pre_s, "decode_step_s": step_s, "decode_s": dec_s, "decode_weights_from":
            ("page cache" if cached else "disk") if offloaded_weight_bytes else "-",
            "prefill_limit": max(t_pre, key=t_pre.__getitem__), "decode_limit": max(t_step, key=t_step.__getitem__),
            "prefill_tok_s": batch * prompt_len / pre_s,
            "decode_tok_s": batch * max(gen_len - 1, 0) / dec_s if dec_s > 0 else float("inf"),
            "total_tok_s": batch * gen_len / (pre_s + dec_s), "prefill_flops": f_pre, "decode_step_flops": f_step}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.machine", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the constants here")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--smoke", action="store_true", help="small sizes, a few seconds")
    p.add_argument("--disk-dir", type=Path, help="scratch folder on the file system to measure")
    a = p.parse_args(argv)
    res = measure(a.threads, a.smoke, a.disk_dir)
    text = json.dumps(res, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
