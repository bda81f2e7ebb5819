"""--uncached-disk-weights: disk-homed weights are read past the page cache, so every pass reads the device.

Checked with util-linux `fincore` (the page-cache residency of each file) on a small dummy store: after a run
without the option the decoder files stay cached; with it, nothing of them is left beyond the partial first
page that holds the .npy header (the advice drops whole pages of the data range only). The generated tokens are
the same either way.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from flexgen_h2o.config import GenerationConfig, OffloadPolicy
from flexgen_h2o.engine import Engine
from flexgen_h2o.memory import drop_file_cache
from flexgen_h2o.models import all_specs, build_layers, resolve_model
from flexgen_h2o.weights import open_store, write_dummy_store

pytestmark = pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux fincore")
PAGE = 4096


def resident(paths) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=True)
    return sum(int(x) for x in out.stdout.split())


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    cfg = resolve_model("opt-125m").replace(n_layers=2, hidden_size=256, n_heads=4, n_kv_heads=4, head_dim=64,
                                            ffn_size=1024, vocab_size=512, max_seq_len=64)
    path = write_dummy_store(cfg, tmp_path_factory.mktemp("s") / "store", progress=False)
    return cfg, path


def run(cfg, path, uncached: bool) -> tuple[list[list[int]], int, int, int]:
    files = sorted(path.glob("layers.*.npy"))
    for f in files:
        drop_file_cache(f)
    assert resident(files) == 0
    reader = open_store(path, all_specs(build_layers(cfg)))
    offload = OffloadPolicy.from_percent([0, 0, 100, 0, 100, 0], gpu_batch_size=2, uncached_disk_weights=uncached)
    with Engine(cfg, reader.read, offload=offload, locate=reader.locate) as engine:
        out = engine.generate([[5, 6, 7, 8], [9, 10]], GenerationConfig(max_new_tokens=4, stop_at_eos=False))
        assert engine.weights.bytes_read["disk"] >= 4 * sum(f.stat().st_size - PAGE for f in files)
    return out.token_ids, resident(files), sum(f.stat().st_size for f in files), len(files)


def test_uncached_disk_weights_leave_the_page_cache_empty(store):
    cfg, path = store
    cached_tokens, cached_res, total, n_files = run(cfg, path, uncached=False)
    uncached_tokens, uncached_res, _, _ = run(cfg, path, uncached=True)
    assert cached_res > 0.9 * total                 # a plain run leaves the decoder weights in the page cache
    assert uncached_res <= n_files * PAGE           # at most each file's header page
    assert uncached_tokens == cached_tokens
