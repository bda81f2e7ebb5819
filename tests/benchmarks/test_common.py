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
