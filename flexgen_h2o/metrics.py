"""Throughput (FlexGen's three definitions), memory readouts (engine accounting and the OS), and the log.

prefill tok/s = B * prompt_len / prefill_s; decode tok/s = B * (gen_len - 1) / decode_s;
total tok/s = B * gen_len / (prefill_s + decode_s)   (`docs/cli.md` "Benchmark mode").
"""
from __future__ import annotations

import resource
import sys
from typing import Any

import psutil

from flexgen_h2o.weights.placement import model_bytes

GIB = 1 << 30


def rss_bytes() -> int:
    """The process's resident set now (psutil)."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """The process's peak resident set, from the OS: Linux's VmHWM (which reset_peak_rss can restart), else
    ru_maxrss (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def reset_peak_rss() -> bool:
    """Restart the OS's peak-RSS window (Linux >= 4.0: write 5 to /proc/self/clear_refs), so a peak can be read
    for one phase (generation) without the loading before it. False where the OS does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def throughput(block: int, prompt_len: int, gen_len: int, prefill_s: float, decode_s: float) -> dict[str, float]:
    return {"prefill_tok_s": block * prompt_len / max(prefill_s, 1e-9),
            "decode_tok_s": block * max(gen_len - 1, 0) / max(decode_s, 1e-9),
            "total_tok_s": block * gen_len / max(prefill_s + decode_s, 1e-9)}


def tier_peaks(engine: Any, weights_in_tiers: bool) -> dict[str, int]:
    """Peak bytes per tier. Resident weights are added when the tiers do not already account for them."""
    peaks = {name: int(tier.peak_bytes) for name, tier in engine.tiers.items()}
    if not weights_in_tiers:
        for name, n in engine.weights.summary().items():
            if name in ("compute", "host"):
                peaks[name] = peaks.get(name, 0) + int(n)
    return peaks


def engine_metrics(llm: Any, weights_in_tiers: bool, *, kv_cache_bytes: int, full_cache_bytes: int,
                   hidden_bytes: int) -> dict[str, Any]:
    """What every mode reports about the model, the placement, the eviction and the memory it used; the modes add
    their own counts and times (run.py's batch and prompt modes, frontends/benchmark.py)."""
    engine, cfg = llm.engine, llm.config
    peaks = tier_peaks(engine, weights_in_tiers)
    device_peak = engine.backend.device_memory()["peak_bytes"]
    return {"model": cfg.name, "hidden_size": cfg.hidden_size, "model_bytes": model_bytes(engine.layers, llm.offload.weight_format),
            "weight_format": llm.offload.weight_format.name, "kv_format": llm.offload.kv_format.name,
            "kv_cache_bytes": kv_cache_bytes, "full_cache_bytes": full_cache_bytes, "hidden_bytes": hidden_bytes,
            # FlexGen's "peak gpu mem": the compute tier (on CUDA, the allocator's own peak when larger)
            "peak_compute_bytes": max(peaks.get("compute", 0), device_peak), "tier_peak_bytes": peaks,
            "device_peak_bytes": device_peak, "weights_by_tier": engine.weights.summary(),
            "percent": list(llm.offload.percent), "eviction": llm.eviction.policy,
            "eviction_request": llm.eviction.describe_request()}


def flexgen_log(m: dict) -> str:
    """FlexGen's 5-line block, so existing parsers (read_benchmark_log) keep working. Sizes in GiB."""
    return (f"model size: {m['model_bytes'] / GIB:.3f} GB\tcache size: {m['full_cache_bytes'] / GIB:.3f} GB\t"
            f"hidden size (p): {m['hidden_bytes'] / GIB:.3f} GB\n"
            f"peak gpu mem: {m['peak_compute_bytes'] / GIB:.3f} GB\tprojected: {m.get('projected', False)}\n"
            f"prefill latency: {m['prefill_s']:.3f} s\tprefill throughput: {m['prefill_tok_s']:.3f} token/s\n"
            f"decode latency: {m['decode_s']:.3f} s\tdecode throughput: {m['decode_tok_s']:.3f} token/s\n"
            f"total latency: {m['prefill_s'] + m['decode_s']:.3f} s\ttotal throughput: "
            f"{m['total_tok_s']:.3f} token/s\n")


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
