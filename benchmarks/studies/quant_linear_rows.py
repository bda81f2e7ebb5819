"""Where a packed int4 weight's product should leave the compiled kernel for the GEMM: csrc/quant_linear.cpp
against ops.linear's dequantized blocks + this CPU's GEMM (what Kernels.linear does above QUANT_LINEAR_MAX_ROWS),
on one 8192 x 2048 matrix (OPT-1.3B's fc1) at a range of rows of x. Best of three calls each, after one warm-up.

    python -m benchmarks.studies.quant_linear_rows --out benchmarks/results/quant-linear-rows
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402


def best_of(f, repeats: int = 3) -> float:
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.quant_linear_rows", description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 4096])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/quant-linear-rows"))
    a = p.parse_args(argv)
    from flexgen_h2o.kernels import resolve
    from flexgen_h2o.models import ops
    from flexgen_h2o.quant import GroupQuant, PackedMatrix
    kernels = resolve()
    if kernels.ext is None or not hasattr(kernels.ext, "quant_linear"):
        raise SystemExit("error: no compiled kernels here (make install builds them)")
    torch.manual_seed(0)
    quant, n_out, n_in = GroupQuant(4, 64), 8192, 2048
    w = PackedMatrix(quant.pack_rows(torch.randn(n_out, n_in) * 0.05), n_in, quant)
    result = {}
    for m in a.rows:
        x = torch.randn(m, n_in)
        cases = {"kernel": lambda: kernels.ext.quant_linear(x, w.rows, n_in, 4, 64),
                 "dequant+gemm": lambda: ops.linear(x, w, None, gemm=kernels._gemm)}
        result[m] = {name: best_of(f) for name, f in cases.items()}
        print(m, "rows:", ", ".join(f"{name} {s * 1e3:.1f} ms ({2 * m * n_in * n_out / s / 1e9:.0f} GFLOP/s)"
                                    for name, s in result[m].items()), flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "rows.json").write_text(json.dumps({"shape": [n_out, n_in], "seconds": result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
