"""H2O's per-layer victim choice as it was at another git revision against the working tree's, interleaved in
one process (old, new, then new, old, ...), on the cache shape of the s2048+512 run: batch 54, 3 KV heads,
409 slots (204 heavy hitters scattered over the past, the 204-token recent window, one free slot), in random
slot order. It times the two functions every decode step calls per layer, `select.newest_mask` (the recent
window) and `select.argmin_score` (the victim), and checks that both versions pick the same victims.

    python -m benchmarks.studies.eviction_ab --old-rev b64ad47
"""
from __future__ import annotations

from benchmarks.studies import ab  # first: it sets OMP_WAIT_POLICY before torch loads

import argparse  # noqa: E402
import sys  # noqa: E402
from statistics import median  # noqa: E402

SELECT_PATH = "flexgen_h2o/kv/select.py"


def cache_columns(batch: int, heads: int, heavy: int, recent: int, newest: int, seed: int = 0):
    """positions (b, g, s) long and scores (b, g, s): heavy random past positions, a consecutive recent
    window ending at `newest`, one free slot (-1), shuffled per column."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    slots = heavy + recent + 1
    pos = torch.empty(batch, heads, slots, dtype=torch.long)
    window = torch.arange(newest - recent + 1, newest + 1)
    for b in range(batch):
        for g in range(heads):
            past = torch.randperm(newest - recent + 1, generator=gen)[:heavy]
            column = torch.cat([past, window, torch.tensor([-1])])
            pos[b, g] = column[torch.randperm(slots, generator=gen)]
    return pos, torch.rand(batch, heads, slots, generator=gen)


def add_shape_arguments(p: argparse.ArgumentParser, out: str) -> None:
    """The cache shape and timing flags this benchmark, benchmarks.studies.policy_cost and commit_cost share."""
    p.add_argument("--batch", type=int, default=54)
    p.add_argument("--heads", type=int, default=3, help="KV heads (SmolLM2: 3)")
    p.add_argument("--heavy", type=int, default=204)
    p.add_argument("--recent", type=int, default=204)
    p.add_argument("--calls", type=int, default=100, help="calls per timed block")
    ab.add_common(p, out, repeats=6)


def main(argv: list[str] | None = None) -> int:
    p = ab.parser("eviction_ab", __doc__)
    ab.add_old_rev(p, "select.py")
    add_shape_arguments(p, "benchmarks/results/eviction_ab")
    a = p.parse_args(argv)
    import torch
    from flexgen_h2o.kv import select
    torch.set_num_threads(a.threads)
    versions = {"old": ab.module_at(a.old_rev, SELECT_PATH, "select_old"), "new": select}
    pos, scores = cache_columns(a.batch, a.heads, a.heavy, a.recent, newest=2600)
    valid = pos >= 0

    def victims(mod):
        return mod.argmin_score(scores, pos, valid & ~mod.newest_mask(pos, valid, a.recent))

    if not torch.equal(victims(versions["old"]), victims(versions["new"])):
        raise SystemExit("error: the two versions chose different victims")
    times = ab.time_interleaved({ver: (lambda mod=mod: victims(mod)) for ver, mod in versions.items()},
                                a.repeats, a.calls)
    result = {"args": ab.args_json(a), "ms_per_layer": times,
              "median_ms": {k: median(v) for k, v in times.items()},
              "old_over_new": median(times["old"]) / median(times["new"])}
    ab.write_result(a.out, result)
    print(f"victim choice per layer ({a.batch} x {a.heads} x {pos.shape[-1]} slots, {a.threads} threads): "
          f"old {result['median_ms']['old']:.3f} ms, new {result['median_ms']['new']:.3f} ms "
          f"(median of {a.repeats}): {result['old_over_new']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
