"""One decode step's KV bookkeeping per layer (stage the window, write the new row, add the step's attention mass,
choose and free a victim), the compiled commit (kernels/csrc/commit_step.cpp) against kv/'s torch ops, interleaved
in one process (torch, compiled, then compiled, torch, ...).

The cache shape is the s2048+512 run's (benchmarks.studies.eviction_ab's columns: heavy hitters scattered over the past,
a consecutive recent window, one free slot, shuffled), in fp16 as the engine keeps it. Both sides start from
the same cache and take the same steps (one token over the budget each, so every column evicts), and the run
checks that they end in the same state, byte for byte.

    python -m benchmarks.studies.commit_cost --batch 120 --out benchmarks/results/commit_cost
"""
from __future__ import annotations

from benchmarks.studies import ab  # first: it sets OMP_WAIT_POLICY before torch loads

import sys  # noqa: E402

from benchmarks.studies.eviction_ab import add_shape_arguments, cache_columns  # noqa: E402

HEAD_DIM = 64            # SmolLM2's
RING = 8                 # distinct step inputs, cycled: the same sequence on both sides


def main(argv: list[str] | None = None) -> int:
    p = ab.parser("commit_cost", __doc__)
    add_shape_arguments(p, "benchmarks/results/commit_cost")
    p.add_argument("--policy", default="h2o", choices=("h2o", "h2o-avg", "h2o-port"))
    a = p.parse_args(argv)
    import torch
    from flexgen_h2o.kernels import Kernels, build
    from flexgen_h2o.kv import Budget, get_policy
    from flexgen_h2o.kv.cache import KVCache
    from flexgen_h2o.models.layer import KVSpec, LayerOutput
    if not ab.kernels_ready(a.threads):
        return 2
    newest = 2600
    pos, scores = cache_columns(a.batch, a.heads, a.heavy, a.recent, newest=newest)
    budget = Budget(0, a.heavy, a.recent, policy=a.policy)
    b, g, slots, d = a.batch, a.heads, pos.shape[-1], HEAD_DIM
    gen = torch.Generator().manual_seed(1)
    ring = [(torch.randn(b, g, 1, d, generator=gen), torch.randn(b, g, 1, d, generator=gen),
             torch.rand(b, g, slots, generator=gen)) for _ in range(RING)]

    def cache(compiled: bool) -> KVCache:
        kernels = Kernels(build.load() if compiled else None)      # the torch side commits with kv/'s torch ops
        c = KVCache(KVSpec(g, d), b, slots, get_policy(a.policy), budget, read_in_place=True, kernels=kernels)
        c.k.copy_(torch.randn(b, g, slots, d, generator=torch.Generator().manual_seed(2)))
        c.v.copy_(c.k)
        c.pos.copy_(pos)
        c.score.copy_(scores.masked_fill(pos < 0, 0.0))
        c.n_used = slots
        return c

    sides = {"torch": cache(False), "compiled": cache(True)}
    taken = {side: 0 for side in sides}

    def step(side: str) -> None:
        c, n = sides[side], taken[side]
        k_new, v_new, mass = ring[n % RING]
        view = c.stage(torch.device("cpu"), torch.float32)
        view.valid.scatter_(2, view.write_slot.unsqueeze(-1), True)
        c.commit_decode(view, LayerOutput(hidden=None, k_new=k_new, v_new=v_new, scores=mass),
                        torch.full((b,), newest + 1 + n))
        taken[side] = n + 1

    run = {side: (lambda side=side: step(side)) for side in sides}
    result = {"args": ab.args_json(a), **ab.timing_summary(ab.time_interleaved(run, a.repeats, a.calls), "torch")}
    same = all(torch.equal(getattr(sides["torch"], t), getattr(sides["compiled"], t))
               for t in ("k", "v", "pos", "score"))
    result["same_state"] = same
    ab.write_timings(a.out, result, "torch", f"KV commit per layer ({a.policy}, {b} x {g} x {slots} slots, fp16, "
                                           f"{a.threads} threads, median of {a.repeats})")
    if not same:
        print("error: the compiled and torch-op commits left different caches", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
