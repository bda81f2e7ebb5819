"""The engine's memory accounting agrees with the OS within 10 % (FlexGen's CPU readout did not, #81).

Each case runs in a fresh process, on an OPT-125M-shaped dummy model, so its peak belongs to it alone. The OS
figure is the peak RSS of the generation phase (VmHWM, restarted just before it) minus what the process held
that the engine does not own (RSS before generation minus the engine's bytes then: the interpreter, torch's
libraries). The engine figure is the sum of its tiers' peaks: resident weights, staging buffers, KV cache,
activations and the estimated workspace of one layer forward. A warm-up run first, so that kernel code pages
and the allocator's first-use growth are in the baseline, as in the CLI's benchmark mode; then malloc_trim, so
the heap the warm-up freed is not in the baseline either (glibc keeps it, and the measured run would reuse it
without raising the peak: that hid about 50 MB of transients, and an over-count of ours with them).

The child fixes glibc's mmap threshold at 1 MiB. By default glibc raises that threshold to the size of each large
block freed (up to 32 MiB), after which blocks of that size come from the heap and stay there when freed in
between live ones: the decode steps' staged windows then left 20-45 MB of freed heap in RSS, varying run to run
(CI once saw 10.4 %). That is the allocator keeping memory the engine has given back, not memory the engine holds;
with the threshold fixed the gap measured 4 MB. docs/architecture.md (Memory accounting) says how a user gets the same.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from flexgen_h2o.metrics import reset_peak_rss

CHILD = textwrap.dedent("""
    import ctypes, json, sys
    import torch
    from flexgen_h2o.config import GenerationConfig, OffloadPolicy
    from flexgen_h2o.engine import Engine
    from flexgen_h2o.loader import load_model
    from flexgen_h2o.metrics import peak_rss_bytes, reset_peak_rss, rss_bytes

    percent, offload_dir = json.loads(sys.argv[1]), sys.argv[2]
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 1 << 20) == 1       # M_MMAP_THRESHOLD fixed: freed large blocks go back to the OS
    torch.set_num_threads(2)
    loaded = load_model("opt-125m", dummy_weights=True, progress=False)
    policy = OffloadPolicy.from_percent(percent, gpu_batch_size=8, num_gpu_batches=2)
    engine = Engine(loaded.config, loaded.read, offload=policy, device="cpu", offload_dir=offload_dir)
    memory = [t for t in engine.tiers.values() if t.kind != "disk"]
    prompts = [[5 + (7 * i + j) % 5000 for j in range(128)] for i in range(16)]
    engine.generate(prompts, GenerationConfig(max_new_tokens=2, stop_at_eos=False))     # warm-up
    engine.release()
    libc.malloc_trim(0)     # hand the warm-up's freed heap back, so the baseline holds none
    owned_before = sum(t.current_bytes for t in memory)
    rss_before = rss_bytes()
    for t in memory:
        t.reset_peak()
    reset_peak_rss()
    engine.generate(prompts, GenerationConfig(max_new_tokens=8, stop_at_eos=False))
    print(json.dumps({"os": peak_rss_bytes() - (rss_before - owned_before),
                      "ours": sum(t.peak_bytes for t in memory),
                      "tiers": {t.name: t.peak_bytes for t in memory}}))
""")


@pytest.mark.skipif(not reset_peak_rss(), reason="this OS cannot restart the peak-RSS window (/proc/self/clear_refs)")
@pytest.mark.parametrize("percent", [[0, 100, 50, 50, 100, 0], [100, 0, 0, 100, 0, 100]],
                         ids=["weights-host-kv-split", "weights-compute-kv-act-host"])
def test_accounted_peak_matches_the_os_within_10_percent(percent, tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(percent), str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["ours"] > 250e6                     # the weights alone: the comparison is about real sizes
    print(m)
    assert abs(m["ours"] - m["os"]) <= 0.10 * m["os"], m
