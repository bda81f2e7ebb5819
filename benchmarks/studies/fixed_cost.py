"""The fixed cost of a schedule layer: what a decode step costs per layer beyond its bytes and FLOPs (the Python
between the ops, the small ops themselves), measured as the calibration measures it (a 4-layer model 64 wide
through the real engine, one sequence: `flexgen_h2o.calibrate.measure_fixed`), but as the best of many runs, since
the VM's noise is the size of the effect. Names the CPU.

    python -m benchmarks.studies.fixed_cost [--rounds 3] [--repeats 15]

To compare two commits, run it from a worktree of each, alternating (`benchmarks/results/fixed-cost-54/NOTES.md`).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from flexgen_h2o.calibrate import cpu_model, measure_fixed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="measurements, each the best of --repeats runs")
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores, torch's ISA {torch.backends.cpu.get_cpu_capability()}")
    for _ in range(a.rounds):
        m = measure_fixed("cpu", repeats=a.repeats)
        print(f"decode {m['fixed_decode_s_per_layer'] * 1e3:.3f} ms, prompt pass "
              f"{m['fixed_prefill_s_per_layer'] * 1e3:.3f} ms per schedule layer", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
