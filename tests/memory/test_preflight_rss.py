"""The preflight's RAM figure is the process's peak RSS, predicted: the measured peak stays under it, and it
leaves no more than 15 % over (docs/architecture.md, "Memory accounting: the preflight's RAM figure").

Each case runs the real CLI in a fresh process and reads its peak two ways: psutil sampling the child's RSS,
and the child's own VmHWM (`peak_rss_bytes` in --metrics-json, which sampling cannot miss). The prediction is
the `preflight: RAM ...` line the CLI prints before it loads anything.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flexgen_h2o.config import OffloadPolicy
from flexgen_h2o.kv import EvictionConfig
from flexgen_h2o.models import PRESETS, StepContext, ops
from flexgen_h2o.planner import estimate
from flexgen_h2o.planner.memory import MMAP_CEILING, allocator_bytes, layer_transients
from flexgen_h2o.weights import store_root
from tests.tiny_checkpoint import REPO, cli_env

MIB = 1 << 20
UNITS = {"GiB": 1 << 30, "MiB": MIB, "KiB": 1 << 10}
DUMMY = ["--model", "opt-125m", "--dummy-weights"]
CASES = [
    pytest.param(DUMMY + ["--gpu-batch-size", "8", "--prompt-len", "256", "--gen-len", "8", "--hh-ratio", "0.2"],
                 id="opt125m-h2o"),
    pytest.param(DUMMY + ["--percent", "100", "0", "0", "100", "100", "0", "--gpu-batch-size", "8", "--prompt-len",
                          "256", "--gen-len", "8", "--hh-ratio", "0.2"], id="opt125m-h2o-kv-on-host"),
    # the allocator's terms matter here: OPT-125M's MLP blocks (48 MiB) are mapped, the attention's heap-served
    pytest.param(DUMMY + ["--gpu-batch-size", "16", "--prompt-len", "512", "--gen-len", "8", "--hh-ratio", "0.1"],
                 id="opt125m-16x512-h2o", marks=pytest.mark.slow),
    pytest.param(["--model", "smollm2-135m", "--gen-len", "64", "--prompt", "Explain in two sentences why the sky "
                  "is blue.", "--prompt", "What is the capital of France?"], id="smollm2-prompts-full",
                 marks=pytest.mark.slow),
]


def run_and_sample(args: list[str], env: dict[str, str], tmp: Path) -> tuple[str, int, dict]:
    """Run the CLI; return its stdout, the largest RSS psutil saw, and its metrics."""
    out, err, mj = tmp / "out.txt", tmp / "err.txt", tmp / "m.json"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen([sys.executable, "-m", "flexgen_h2o.run", *args, "--no-progress",
                                 "--metrics-json", str(mj)], env=env, cwd=REPO, stdout=fo, stderr=fe)
        child, seen, t0 = psutil.Process(proc.pid), 0, time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < 900:
            try:
                seen = max(seen, child.memory_info().rss)
            except psutil.Error:     # exited between poll() and the read
                break
            time.sleep(0.005)
        proc.wait(timeout=60)
    assert proc.returncode == 0, err.read_text()[-3000:]
    return out.read_text(), seen, json.loads(mj.read_text())


@pytest.mark.parametrize("args", CASES)
def test_measured_peak_rss_is_covered_by_the_preflight(args, tmp_path):
    home = store_root() if "smollm2-135m" in args else tmp_path / "home"     # SmolLM2: the converted store
    stdout, sampled, m = run_and_sample(args, cli_env(home), tmp_path)
    found = re.search(r"preflight: RAM ([\d.]+) (GiB|MiB|KiB) of", stdout)
    assert found, stdout[-2000:]
    predicted = float(found.group(1)) * UNITS[found.group(2)]
    measured = max(sampled, m["peak_rss_bytes"])
    print(f"{' '.join(args)}: predicted {predicted / MIB:.1f} MiB, measured {measured / MIB:.1f} MiB "
          f"(sampled {sampled / MIB:.1f}), ratio {predicted / measured:.3f}")
    assert measured <= predicted <= 1.15 * measured


@pytest.mark.parametrize("model, rows, tokens", [("opt-125m", 8, 512), ("smollm2-135m", 2, 2048),
                                                  ("opt-1.3b", 8, 512), ("llama-7b", 1, 64)])
@pytest.mark.parametrize("scored", [False, True])
def test_layer_transients_are_the_workspace_formulas_tensors(model, rows, tokens, scored):
    """allocator_bytes splits ModelConfig.workspace_bytes tensor by tensor; the two must not drift apart."""
    cfg = PRESETS[model]
    block = ops.score_block_bytes(rows, cfg.n_heads, tokens, StepContext.query_chunk, "cpu") if scored else 0
    hidden, phases = layer_transients(cfg, rows, tokens, 4, block)
    assert sum(hidden) + max(sum(t) for t in phases.values()) == cfg.workspace_bytes(rows, tokens, 4, block)


def test_mmap_split_only_where_a_phase_is_mapped():
    """OPT-125M's MLP at 8 x 512 tokens is 2 x 48 MiB (mapped, over glibc's ceiling) while its attention's
    12 MiB blocks are heap-served: the peak holds both (60 MiB more than the larger phase). SmolLM2's largest
    block there is 24 MiB: every phase is heap-served and reuses the same pages, so no split."""
    opt, smol = PRESETS["opt-125m"], PRESETS["smollm2-135m"]
    assert 4096 * opt.ffn_size * 4 > MMAP_CEILING > 4096 * smol.ffn_size * 4
    assert allocator_bytes(opt, 8, 512, 4, 0, 0)["mmap split"] == 60 * MIB
    assert allocator_bytes(smol, 8, 512, 4, 0, 0)["mmap split"] == 0
    # the terms reach the estimate on a CPU only: on a GPU the transients are device memory
    off, ev = OffloadPolicy(gpu_batch_size=16), EvictionConfig()
    assert estimate(opt, off, ev, prompt_len=512, gen_len=8, device_type="cpu").beyond_tiers["mmap split"] == 60 * MIB
    assert estimate(opt, off, ev, prompt_len=512, gen_len=8, device_type="cuda").beyond_tiers == {}
