"""benchmarks.common's process-memory sampler, against what the kernel really does with a mapped file."""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from benchmarks.common import RssSampler, rss_parts

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm is Linux's")


def test_mapped_file_pages_count_as_file_backed_not_anon(tmp_path):
    """The reason the suite reports the split: reading a memory-mapped weight file raises the file-backed part of
    the RSS by the pages touched, while the anonymous part stays put. VmHWM charges those pages to the process."""
    size = 64 << 20
    path = tmp_path / "w.dat"
    path.write_bytes(b"\1" * size)
    before = rss_parts()
    assert before["rss"] == before["anon"] + before["file"] and before["file"] > 0     # libraries are mapped
    with RssSampler(interval_s=0.005) as sampler:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        assert int(mm[::4096].astype(np.int64).sum()) == size // 4096      # touch every page
        during = rss_parts()
        time.sleep(0.05)                      # at least one sample with the mapping live
        del mm
    assert during["file"] - before["file"] > 0.9 * size
    assert during["anon"] - before["anon"] < 0.25 * size
    assert sampler.growth("file") > 0.9 * size and sampler.growth("anon") < 0.25 * size
    assert sampler.peak >= during["rss"] > before["rss"] + 0.9 * size


def test_sampler_catches_a_short_lived_peak():
    """hf_cache reads its peak RSS from this sampler: an allocation freed again inside the block still shows."""
    with RssSampler(interval_s=0.002) as sampler:
        start = sampler.start["rss"]
        block = np.ones(48 << 20, dtype=np.uint8)          # 48 MiB, touched
        time.sleep(0.03)
        del block
    assert sampler.peak - start > 40 << 20
    assert sampler.growth("anon") > 40 << 20


def test_every_benchmark_names_its_cpu_isa():
    """The machine record and the report's machine line say which vector extensions the CPU has, as its
    /proc/cpuinfo flags list them (an AVX2-only VM and an AVX512_BF16 one give different numbers)."""
    from benchmarks.suite_report import machine_line
    from flexgen_h2o.calibrate import ISA_NAMES, cpu_isa
    with open("/proc/cpuinfo") as f:
        flags = set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    isa = cpu_isa()
    assert isa.split() == [name for flag, name in ISA_NAMES if flag in flags] or isa == "no AVX2"
    m = {"date": "2026-12-08", "cpu": "AMD EPYC", "isa": isa, "threads": 2, "torch": "2.13.0",
         "gemm_decode_GFLOPs": {"1": 9.0, "8": 24.0, "64": 90.0}, "gemm_prefill_GFLOPs": 101.0,
         "gemm_prefill_rows": 2048, "memcpy_GBps": 23.7, "mem_read_GBps": 21.1, "disk_write_GBps": 0.29,
         "disk_read_GBps": 2.46, "gpu": None}
    assert machine_line(m).startswith(f"Machine (2026-12-08, AMD EPYC ({isa}), 2 threads")
