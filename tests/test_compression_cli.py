"""--compress-cache / --compress-weight through the CLI and the preflight: the startup lines name the formats and
their bytes, bad values are one error line, and a compressed run fits where the fp16 one is refused."""
from __future__ import annotations

import re

import pytest

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import PRESETS
from flexgen_h2o.planner import Machine, PreflightError, checks, estimate, preflight
from tests.tiny_checkpoint import cli_env, run_main

GIB = 1 << 30


def test_the_startup_lines_show_the_formats_and_their_bytes(tmp_path):
    proc = run_main(["--model", "opt-125m", "--dummy-weights", "--compress-cache", "--compress-weight",
                     "--prompt-len", "16", "--gen-len", "2", "--gpu-batch-size", "2", "--no-progress"],
                    cli_env(tmp_path / "home"))
    assert proc.returncode == 0, proc.stderr
    plan = next(line for line in proc.stdout.splitlines() if line.startswith("plan:"))
    # 12 heads of 64: K and V 36 bytes each (32 of int4 values, an fp16 minimum and step), score and position 8
    assert "int4-g64 (960 B/token/layer)" in plan and "| weights int4-g64" in plan
    assert re.search(r"^model size: [\d.]+ MiB int4-g64", proc.stdout, re.M)


@pytest.mark.parametrize("flag, value, says", [("--kv-bits", "3", "--kv-bits: invalid choice: 3"),
                                               ("--weight-bits", "16", "--weight-bits: invalid choice: 16"),
                                               ("--group-size", "0", "--group-size: must be >= 1, got 0")])
def test_bad_compression_values_are_one_error_line(tmp_path, flag, value, says):
    proc = run_main(["--model", "opt-125m", "--dummy-weights", "--compress-cache", flag, value], cli_env(tmp_path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0]


def test_compressed_weights_fit_where_fp16_ones_are_refused():
    cfg, ev, kw = PRESETS["opt-1.3b"], EvictionConfig(), dict(prompt_len=512, gen_len=32)
    small = Machine(ram_available=2.0 * GIB, ram_total=8 * GIB)
    with pytest.raises(PreflightError):
        preflight(cfg, OffloadPolicy(), ev, machine=small, **kw)
    est, results = preflight(cfg, OffloadPolicy(weight_bits=4), ev, machine=small, **kw)
    assert all(c.ok for c in results) and est.tier_total("compute") < 2.0 * GIB


def test_a_compressed_cache_fits_a_batch_that_fp16_cannot():
    """The suite's s2048+512 budget: H2O at 20 % with 4-bit KV holds >= 2.5x the sequences of fp16 KV."""
    cfg, ev, kw = PRESETS["smollm2-135m"], EvictionConfig(policy="h2o", hh_ratio=0.1), dict(prompt_len=2048,
                                                                                           gen_len=512)
    budget = Machine(ram_available=2.0 * GIB, ram_total=8 * GIB)

    def fits(batch: int, kv_bits: int | None) -> bool:
        off = OffloadPolicy(gpu_batch_size=batch, kv_bits=kv_bits)
        return all(c.ok for c in checks(estimate(cfg, off, ev, n_seqs=batch, **kw), budget))

    plain = max(b for b in range(8, 1024, 8) if fits(b, None))
    assert not fits(3 * plain, None) and fits(3 * plain, 4)
    fp16_kv = estimate(cfg, OffloadPolicy(gpu_batch_size=64), ev, n_seqs=64, **kw).kv_bytes
    int4_kv = estimate(cfg, OffloadPolicy(gpu_batch_size=64, kv_bits=4), ev, n_seqs=64, **kw).kv_bytes
    assert int4_kv / fp16_kv == pytest.approx(240 / 792, rel=0.01)      # bytes per token and layer, below
