"""A decode step's element-wise layer math on a CPU, one call of each op at `--rows` sequences (SmolLM2 shapes):
the torch ops on `--threads` threads, the same ops on one thread, and csrc/layer_math.cpp, interleaved in one
process. With OMP_WAIT_POLICY=PASSIVE each torch op over ~100k floats is a parallel region that first wakes the
sleeping OpenMP threads; the one-thread column shows what the wake-ups cost. `cos/sin` is RoPE's angle table
(no kernel: a step now computes it once, not once per layer). `--tokens T` times a prompt's rows instead (T
tokens per sequence), where the kernel splits the work across `--threads` threads.

    python -m benchmarks.studies.layer_math_cost --rows 120 --out benchmarks/results/layer_math_cost
    # a prompt pass's chunk: 2 sequences of 2,048 tokens
    python -m benchmarks.studies.layer_math_cost --rows 2 --tokens 2048 --calls 5 \
        --out benchmarks/results/layer_math_prompt
"""
from __future__ import annotations

from benchmarks.studies import ab  # first: it sets OMP_WAIT_POLICY before torch loads

import sys  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = ab.parser("layer_math_cost", __doc__)
    p.add_argument("--rows", type=int, default=120, help="sequences of a decode step")
    p.add_argument("--tokens", type=int, default=1, help="tokens per sequence (1: a decode step; more: a prompt)")
    p.add_argument("--calls", type=int, default=200, help="calls per timed block")
    ab.add_common(p, "benchmarks/results/layer_math_cost", repeats=6)
    a = p.parse_args(argv)
    import torch
    import torch.nn.functional as F
    from flexgen_h2o.kernels import Kernels, build
    from flexgen_h2o.models import ops
    if ab.kernels_missing():
        return 2
    gen = torch.Generator().manual_seed(0)
    b, t = a.rows, a.tokens
    x, w = torch.randn(b, t, 576, generator=gen), torch.randn(576, generator=gen).half()
    gate, up = torch.randn(b, t, 1536, generator=gen), torch.randn(b, t, 1536, generator=gen)
    scratch = torch.empty_like(gate)
    q = torch.randn(b, t, 9 * 64, generator=gen).view(b, t, 9, 64).transpose(1, 2)       # split_heads' view
    positions = torch.randint(500, 1100, (b, 1), generator=gen) + torch.arange(t)
    inv_freq = ops.rope_inv_freq(64, 100000.0)                                     # SmolLM2's
    cos, sin = (t[:, None] for t in ops.rope_cos_sin(positions, inv_freq, torch.float32))

    def torch_ops(fn, threads: int):
        def run() -> None:
            torch.set_num_threads(threads)
            fn()
        return run

    def kernel(fn):
        def run() -> None:
            # a decode step's tensors run serially in the kernel (so does the scratch copy); a prompt's split
            torch.set_num_threads(1 if t == 1 else a.threads)
            fn()
        return run

    compiled = Kernels(build.load())
    ops_to_time = {
        "RMSNorm": (lambda: ops.rms_norm(x, w, 1e-5), lambda: compiled.rms_norm(x, w, 1e-5)),
        # the kernel writes into its gate: a copy into scratch first, so its figure is an upper bound
        "silu(gate) * up": (lambda: F.silu(gate) * up, lambda: compiled.ext.silu_mul_(scratch.copy_(gate), up)),
        "RoPE of q": (lambda: ops.apply_rope(q, cos, sin), lambda: compiled.apply_rope(q, cos, sin)),
        "cos/sin": (lambda: ops.rope_cos_sin(positions, inv_freq, torch.float32), None),
    }
    before = torch.get_num_threads()
    summary = {}
    try:
        for name, (torch_fn, kernel_fn) in ops_to_time.items():
            run = {f"torch, {a.threads} threads": torch_ops(torch_fn, a.threads),
                   "torch, 1 thread": torch_ops(torch_fn, 1)}
            if kernel_fn is not None:
                run["kernel"] = kernel(kernel_fn)
            times = ab.time_interleaved(run, a.repeats, a.calls)
            summary[name] = ab.timing_summary(times, f"torch, {a.threads} threads")
    finally:
        torch.set_num_threads(before)
    us = {name: {case: 1e3 * ms for case, ms in s["median_ms"].items()} for name, s in summary.items()}
    result = {"args": ab.args_json(a), "ops": summary, "median_us": us}
    ab.write_ab(a.out, result, "median_us",
                lambda name, cases: f"{name} ({a.rows} rows x {t} tokens, median of {a.repeats}): "
                                    + ", ".join(f"{case} {us:.1f} us" for case, us in cases.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
