"""One layer's prompt attention alone, three ways, interleaved in one process: torch's fused SDPA (what a
full-cache prompt runs: no key mass), the torch-op scored path (ops.grouped_attention with want_scores) and the
compiled kernel (kernels/csrc/scored_attention.cpp, output and key mass in one pass). SmolLM2's shape by
default: 9 query heads, 3 KV heads, head size 64. Random q, k, v; no pads.

    python -m benchmarks.studies.prompt_attention --out benchmarks/results/prompt_attention
    # a kernel change: `scored-kernel@REV` is csrc/ as it was at git revision REV, built beside the working tree's
    python -m benchmarks.studies.prompt_attention --base 1f7d688 --out benchmarks/results/prompt_attention_ab
"""
from __future__ import annotations

from benchmarks.studies import ab  # first: it sets OMP_WAIT_POLICY before torch loads

import sys  # noqa: E402


CASES = ("sdpa", "scored-torch", "scored-kernel")


def main(argv: list[str] | None = None) -> int:
    p = ab.parser("prompt_attention", __doc__)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=64)
    ab.add_common(p, "benchmarks/results/prompt_attention", repeats=6,
                  base="also time the kernels of this git revision (scored-kernel@REV)")
    a = p.parse_args(argv)
    import torch
    from flexgen_h2o.kernels import Kernels, build
    from flexgen_h2o.models import ops
    if not ab.kernels_ready(a.threads):
        return 2
    gen = torch.Generator().manual_seed(0)
    b, t, d = a.batch, a.prompt_len, a.head_dim
    q = torch.randn(b, t, a.heads, d, generator=gen).transpose(1, 2)          # a head view, as split_heads gives
    k, v = (torch.randn(b, a.kv_heads, t, d, generator=gen) for _ in range(2))
    scale = d ** -0.5
    mask = ops.causal_pad_mask(torch.ones(b, t, dtype=torch.bool))
    valid = torch.ones(b, t, dtype=torch.bool)

    def kernel_of(kernels):
        return lambda: kernels.scored_prompt_attention(q, k, v, valid, True, scale, "sum", 256)

    run = {"sdpa": lambda: ops.grouped_attention(q, k, v, mask, scale, causal_only=True),
           "scored-torch": lambda: ops.grouped_attention(q, k, v, mask, scale, want_scores=True, causal_only=True),
           "scored-kernel": kernel_of(Kernels(build.load())),
           **({f"scored-kernel@{a.base}": kernel_of(ab.kernels_at(a.base))} if a.base else {})}
    results = {name: f() for name, f in run.items()}                          # warm-up, and the same values
    same_out = all(torch.allclose(results["sdpa"][0], out, atol=1e-4) for out, _ in results.values())
    same_mass = all(torch.allclose(results["scored-torch"][1], mass, rtol=1e-4, atol=1e-4)
                    for _, mass in results.values() if mass is not None)
    if not (same_out and same_mass):
        print("error: the paths disagree (output or key mass)", file=sys.stderr)
        return 2
    times = ab.time_interleaved(run, a.repeats)
    result = {"args": ab.args_json(a), **ab.timing_summary(times, "sdpa")}
    ab.write_timings(a.out, result, "sdpa", f"prompt attention per layer ({b} x {a.heads}/{a.kv_heads} heads x {t}, "
                                            f"{a.threads} threads, median of {a.repeats})", digits=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
