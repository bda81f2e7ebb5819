"""The linear layers' rates by rows of x: the engine's `Kernels.linear` per weight format (fp16, int8, int4; the
calibration's measurement, `flexgen_h2o.calibrate.measure_linear`, a 1024 x 2816 weight, more of them than the
last-level cache holds) beside the fp32 GEMMs a CPU has (torch's default, MKL, and oneDNN), in GFLOP/s. Names the
CPU. Writes the table and, with --out, its JSON.

    python -m benchmarks.studies.linear_rates [--out FILE]
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flexgen_h2o.calibrate import LINEAR_K, LINEAR_N, ROWS, best_time, cpu_model, measure_linear  # noqa: E402
from flexgen_h2o.kernels import resolve  # noqa: E402
from flexgen_h2o.kernels.dispatch import onednn_gemm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--min-s", type=float, default=0.3, help="seconds of calls per measurement")
    a = p.parse_args(argv)
    res = measure_linear(resolve(), torch.device("cpu"), torch.float32, lambda: None, a.min_s)
    weights = [torch.randn(LINEAR_N, LINEAR_K) * 0.02 for _ in range(4)]
    gemms = {"fp32-mkl": F.linear}
    if onednn_gemm() is not None:
        gemms["fp32-onednn"] = lambda x, w: onednn_gemm()(x, w, None, "none", [], "")
    for name, gemm in gemms.items():
        res[name] = {}
        for rows in ROWS:
            x = torch.randn(rows, LINEAR_K)
            turn = iter(range(1 << 62))
            t = best_time(lambda: gemm(x, weights[next(turn) % len(weights)]), a.min_s)
            res[name][str(rows)] = 2 * rows * LINEAR_K * LINEAR_N / t / 1e9
    cpu = f"{cpu_model()}, {os.cpu_count()} cores, torch's ISA {torch.backends.cpu.get_cpu_capability()}"
    print(f"cpu: {cpu}\nGFLOP/s by rows of x   " + " ".join(f"{r:>7}" for r in ROWS))
    for name, by_rows in res.items():
        print(f"{name:22s} " + " ".join(f"{by_rows[str(r)]:7.1f}" for r in ROWS))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": cpu, "shape": [LINEAR_K, LINEAR_N], "gflops": res}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
