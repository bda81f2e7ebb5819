"""H2O's per-layer victim choice as it was at another git revision against the working tree's, interleaved in
one process (old, new, then new, old, ...), on the cache shape of the s2048+512 run: batch 54, 3 KV heads,
409 slots (204 heavy hitters scattered over the past, the 204-token recent window, one free slot), in random
slot order. It times the two functions every decode step calls per layer, `select.newest_mask` (the recent
window) and `select.argmin_score` (the victim), and checks that both versions pick the same victims.

    python -m benchmarks.eviction_ab --old-rev b64ad47
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
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
    """The cache shape and timing flags this benchmark and benchmarks.policy_cost share."""
    p.add_argument("--batch", type=int, default=54)
    p.add_argument("--heads", type=int, default=3, help="KV heads (SmolLM2: 3)")
    p.add_argument("--heavy", type=int, default=204)
    p.add_argument("--recent", type=int, default=204)
    p.add_argument("--calls", type=int, default=100, help="calls per timed block")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eviction_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--old-rev", required=True, help="git revision whose select.py is the baseline")
    add_shape_arguments(p, "benchmarks/results/eviction_ab")
    a = p.parse_args(argv)
    import torch
    from benchmarks.common import module_at
    from flexgen_h2o.kv import select
    torch.set_num_threads(a.threads)
    versions = {"old": module_at(a.old_rev, SELECT_PATH, "select_old"), "new": select}
    pos, scores = cache_columns(a.batch, a.heads, a.heavy, a.recent, newest=2600)
    valid = pos >= 0

    def victims(mod):
        return mod.argmin_score(scores, pos, valid & ~mod.newest_mask(pos, valid, a.recent))

    if not torch.equal(victims(versions["old"]), victims(versions["new"])):
        raise SystemExit("error: the two versions chose different victims")
    times: dict[str, list[float]] = {"old": [], "new": []}
    for rep in range(a.repeats):
        for ver in (["old", "new"] if rep % 2 == 0 else ["new", "old"]):
            start = time.perf_counter()
            for _ in range(a.calls):
                victims(versions[ver])
            times[ver].append(1e3 * (time.perf_counter() - start) / a.calls)
    result = {"args": {k: str(v) for k, v in vars(a).items()}, "ms_per_layer": times,
              "median_ms": {k: median(v) for k, v in times.items()},
              "old_over_new": median(times["old"]) / median(times["new"])}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"victim choice per layer ({a.batch} x {a.heads} x {pos.shape[-1]} slots, {a.threads} threads): "
          f"old {result['median_ms']['old']:.3f} ms, new {result['median_ms']['new']:.3f} ms "
          f"(median of {a.repeats}): {result['old_over_new']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
