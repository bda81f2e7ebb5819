"""A decode step's linear layers against fp16 weights on a CPU: ops.linear's two paths, interleaved in one process
(blas, kernel, then kernel, blas, ...). `blas` upcasts the weight a chunk of rows at a time and multiplies with
torch's GEMM; `kernel` converts it a few rows at a time in L1 (kernels/csrc/half_linear.cpp). The shapes are
SmolLM2's projections and its LM head, one weight tensor per layer as in the model (a step reads 270 MB of them
from memory), at `--rows` rows (the batch of a decode step).

`blas-fp32` multiplies the same values kept in fp32 (540 MB, twice the engine's resident weights) with torch's
GEMM and nothing else: what this CPU's BLAS gives the step's shapes with no conversion at all. `peak-gemm` is
benchmarks/machine.py's prefill-shape product (2048 x 2048 x 2048 fp32), the rate the roofline prices FLOPs at,
timed in the same rotation so the VM's drift lands on it too. The JSON has each case's GFLOP/s and each linear
case's time over its FLOPs at the peak case's rate (how far the step's linear layers alone are from their share
of the bound; benchmarks/results/suite-log/NOTES.md).

    python -m benchmarks.studies.linear_cost --rows 120 --out benchmarks/results/linear_cost
    # a change to the kernel: `kernel@REV` is half_linear.cpp as it was at git revision REV, built beside it
    python -m benchmarks.studies.linear_cost --rows 120 --base 09ad2d5 --out benchmarks/results/linear_cost_ab
"""
from __future__ import annotations

from benchmarks.studies import ab  # first: it sets OMP_WAIT_POLICY before torch loads

import sys  # noqa: E402


# (out features, in features) of SmolLM2-135M's matrices, with how many of each a decode step multiplies
SHAPES = {"q/o (576 x 576)": (576, 576, 60), "k/v (192 x 576)": (192, 576, 60),
          "gate/up (1536 x 576)": (1536, 576, 60), "down (576 x 1536)": (576, 1536, 30),
          "head (49152 x 576)": (49152, 576, 1)}
PEAK_ROWS = 2048            # benchmarks/machine.py's prefill-shape GEMM: the rate the roofline's bound uses


def main(argv: list[str] | None = None) -> int:
    p = ab.parser("linear_cost", __doc__)
    p.add_argument("--rows", type=int, default=120, help="rows of x: the sequences of a decode step")
    p.add_argument("--calls", type=int, default=5, help="calls per timed block")
    ab.add_common(p, "benchmarks/results/linear_cost", repeats=6,
                  base="also time the kernels of this git revision (case kernel@REV)")
    a = p.parse_args(argv)
    import torch
    from flexgen_h2o.kernels import build
    from flexgen_h2o.models import ops
    if not ab.kernels_ready(a.threads):
        return 2
    gen = torch.Generator().manual_seed(0)
    # one tensor per layer, as in the model: a step streams all 270 MB of them from memory, where one tensor per
    # shape multiplied `count` times stays in the caches (the L3 holds every layer's matrix of one shape)
    weights = {name: [(torch.randn(n, k, generator=gen) * 0.05).half() for _ in range(count)]
               for name, (n, k, count) in SHAPES.items()}
    xs = {name: torch.randn(a.rows, k, generator=gen) for name, (_, k, _) in SHAPES.items()}
    # the same values in fp32, multiplied as x @ w.t() with no conversion (the BLAS's own rate at these shapes)
    weights32 = {name: [w.float() for w in ws] for name, ws in weights.items()}
    flops = sum(2 * a.rows * n * k * count for n, k, count in SHAPES.values())
    square = [torch.randn(PEAK_ROWS, PEAK_ROWS, generator=gen) for _ in range(2)]
    builds = {"kernel": build.load(), **({f"kernel@{a.base}": ab.kernels_at(a.base).ext} if a.base else {})}

    def product(ext):
        """x @ w.T by `ext`'s fp16-weight kernel (None: ops.linear, the upcast chunks and the BLAS)."""
        return ops.linear if ext is None else (lambda x, w: ext.half_linear(x, w))

    def step(ext=None) -> None:
        """One decode step's worth of products: every matrix as often as the model multiplies it."""
        mul = product(ext)
        for name in SHAPES:
            for w in weights[name]:
                mul(xs[name], w)

    def step_fp32() -> None:
        for name in SHAPES:
            for w in weights32[name]:
                torch.mm(xs[name], w.t())

    cases = {"blas": step, "blas-fp32": step_fp32,
             **{name: (lambda e=ext: step(e)) for name, ext in builds.items()},
             "peak-gemm": lambda: torch.mm(*square)}
    times = ab.time_interleaved(cases, a.repeats, a.calls)
    blas = {name: ops.linear(xs[name], weights[name][0]) for name in SHAPES}
    worst = max((torch.mm(xs[n], weights32[n][0].t()) - blas[n]).abs().max().item() for n in SHAPES)
    for ext in builds.values():
        mul = product(ext)
        worst = max(worst, *((mul(xs[n], weights[n][0]) - blas[n]).abs().max().item() for n in SHAPES))
    summary = ab.timing_summary(times, "blas")
    case_flops = {n: (2 * PEAK_ROWS ** 3 if n == "peak-gemm" else flops) for n in times}
    rates = {n: case_flops[n] / ms / 1e6 for n, ms in summary["median_ms"].items()}
    result = {"args": ab.args_json(a), **summary, "flops_per_step": flops,
              "GFLOPs": rates, "over_peak_bound": {n: rates["peak-gemm"] / r for n, r in rates.items()
                                                   if n != "peak-gemm"},
              "max_abs_difference": worst}
    ab.write_timings(a.out, result, "blas", f"a decode step's linear layers ({a.rows} rows, SmolLM2 shapes, "
                                          f"{a.threads} threads, median of {a.repeats}; max |difference| {worst:.1e})")
    print("GFLOP/s: " + ", ".join(f"{n} {r:.1f}" for n, r in result["GFLOPs"].items()) + "; time over the FLOPs "
          "at the peak case's rate: " + ", ".join(f"{n} {r:.2f}x" for n, r in result["over_peak_bound"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
