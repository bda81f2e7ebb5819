"""benchmarks.common's process-memory helpers, against what the kernel really does with a mapped file."""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from benchmarks.common import RssSplitPeaks, rss_split

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")


def test_mapped_file_pages_show_as_rss_file_not_anon(tmp_path):
    """The reason the suite reports the split: reading a memory-mapped weight file raises RssFile by the pages
    touched, while RssAnon stays put. A peer that np.memmap's its weights is charged those pages by VmHWM."""
    size = 64 << 20
    path = tmp_path / "w.dat"
    path.write_bytes(b"\1" * size)
    before = rss_split()
    assert {"RssAnon", "RssFile"} <= before.keys()
    with RssSplitPeaks(interval_s=0.005) as peaks:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        assert int(mm[::4096].astype(np.int64).sum()) == size // 4096      # touch every page
        during = rss_split()
        time.sleep(0.05)                      # at least one sample with the mapping live
        del mm
    assert during["RssFile"] - before["RssFile"] > 0.9 * size
    assert during["RssAnon"] - before["RssAnon"] < 0.25 * size
    assert peaks.peaks["RssFile"] - before["RssFile"] > 0.9 * size
    assert peaks.growth("RssFile") > 0.9 * size and peaks.growth("RssAnon") < 0.25 * size
    assert peaks.peaks["RssFile"] >= peaks.peaks.get("RssShmem", 0)
