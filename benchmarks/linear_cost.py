"""A decode step's linear layers against fp16 weights on a CPU: ops.linear's two paths, interleaved in one process
(blas, kernel, then kernel, blas, ...). `blas` upcasts the weight a chunk of rows at a time and multiplies with
torch's GEMM; `kernel` converts it a few rows at a time in L1 (models/csrc/half_linear.cpp). The shapes are one
SmolLM2 layer's projections and its LM head, at `--rows` rows (the batch of a decode step).

    python -m benchmarks.linear_cost --rows 120 --out benchmarks/results/linear_cost
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.common import kernels_missing, time_interleaved, timing_summary, write_timings  # noqa: E402

# (out features, in features) of SmolLM2-135M's matrices, with how many of each a decode step multiplies
SHAPES = {"q/o (576 x 576)": (576, 576, 60), "k/v (192 x 576)": (192, 576, 60),
          "gate/up (1536 x 576)": (1536, 576, 60), "down (576 x 1536)": (576, 1536, 30),
          "head (49152 x 576)": (49152, 576, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.linear_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=120, help="rows of x: the sequences of a decode step")
    p.add_argument("--calls", type=int, default=5, help="calls per timed block")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/linear_cost"))
    a = p.parse_args(argv)
    import torch
    from flexgen_h2o.models import ops
    if kernels_missing():
        return 2
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(n, k, generator=gen) * 0.05).half() for name, (n, k, _) in SHAPES.items()}
    xs = {name: torch.randn(a.rows, k, generator=gen) for name, (_, k, _) in SHAPES.items()}
    limit = ops.HALF_LINEAR_MAX_ROWS

    def step(kernel: bool) -> None:
        """One decode step's worth of products: every matrix as often as the model multiplies it."""
        ops.HALF_LINEAR_MAX_ROWS = a.rows if kernel else 0
        for name, (_, _, count) in SHAPES.items():
            for _ in range(count):
                ops.linear(xs[name], weights[name])

    try:
        times = time_interleaved({"blas": lambda: step(False), "kernel": lambda: step(True)}, a.repeats, a.calls)
        ops.HALF_LINEAR_MAX_ROWS = 0
        blas = {name: ops.linear(xs[name], weights[name]) for name in SHAPES}
        ops.HALF_LINEAR_MAX_ROWS = a.rows
        worst = max((ops.linear(xs[name], weights[name]) - blas[name]).abs().max().item() for name in SHAPES)
    finally:
        ops.HALF_LINEAR_MAX_ROWS = limit
    result = {"args": {k: str(v) for k, v in vars(a).items()}, **timing_summary(times, "blas"),
              "max_abs_difference": worst}
    write_timings(a.out, result, "blas", f"a decode step's linear layers ({a.rows} rows, SmolLM2 shapes, "
                                       f"{a.threads} threads, median of {a.repeats}; max |difference| {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
