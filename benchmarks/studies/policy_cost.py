"""What each scoring policy's victim choice costs per decode step and layer, side by side in one process.

The cache shape is the s2048+512 run's (batch 54, 3 KV heads, 204 heavy hitters scattered over the past, a
204-token recent window, random slot order; benchmarks.studies.eviction_ab builds it), with the step's new token
written into the free slot, so every column is one over its budget and must choose a victim. Every policy
chooses from the same tensors, in an interleaved order (A B C, then C B A, ...) so the VM's drift hits all of
them alike. h2o-avg divides the scores by each key's query count before the same arg-min as h2o.

    python -m benchmarks.studies.policy_cost --out benchmarks/results/policy_cost
"""
from __future__ import annotations

from benchmarks.studies import ab  # first: it sets OMP_WAIT_POLICY before torch loads

import sys  # noqa: E402

from benchmarks.studies.eviction_ab import add_shape_arguments, cache_columns  # noqa: E402

POLICIES = ("h2o", "h2o-port", "h2o-avg")


def main(argv: list[str] | None = None) -> int:
    p = ab.parser("policy_cost", __doc__)
    add_shape_arguments(p, "benchmarks/results/policy_cost")
    a = p.parse_args(argv)
    import torch
    from flexgen_h2o.kv import Budget, get_policy
    torch.set_num_threads(a.threads)
    pos, scores = cache_columns(a.batch, a.heads, a.heavy, a.recent, newest=2600)
    pos[pos < 0] = 2601                     # the decode step has written its token into the free slot
    budget = Budget(0, a.heavy, a.recent)
    victims = {name: get_policy(name).choose_victim(scores, pos, budget) for name in POLICIES}
    if not all(bool((v >= 0).all()) for v in victims.values()):
        raise SystemExit("error: a column chose no victim: the shape must hold one token over the budget")
    run = {name: (lambda policy=get_policy(name): policy.choose_victim(scores, pos, budget)) for name in POLICIES}
    result = {"args": ab.args_json(a), **ab.timing_summary(ab.time_interleaved(run, a.repeats, a.calls), "h2o"),
              "victims_differ_from_h2o": {name: int((victims[name] != victims["h2o"]).sum()) for name in POLICIES}}
    ab.write_timings(a.out, result, "h2o", f"victim choice per layer ({a.batch} x {a.heads} x {pos.shape[-1]} slots, "
                                         f"{a.threads} threads, median of {a.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
