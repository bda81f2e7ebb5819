"""The prompt pass with `ops.grouped_attention` as it was at another git revision against the working tree's,
interleaved in one process (old, new, then new, old, ...), so the VM's drift lands on both alike.

Everything but the attention function is the working tree's: the same engine, prompts (Wikipedia windows) and
cache rules as benchmarks/studies/profile_decode.py. The old function gets only the keyword arguments its signature has.
With --old-rev both sides run the torch-op path (the compiled prompt attention is switched off); with --compiled
the two sides are the working tree's torch-op path and its compiled kernel.

    python -m benchmarks.studies.attention_ab --old-rev ff410d4 --out benchmarks/results/attention_ab
    # the torch-op path (old) against the compiled prompt attention (new, kernels/csrc/scored_attention.cpp)
    # of the working tree
    python -m benchmarks.studies.attention_ab --compiled --out benchmarks/results/attention_ab_compiled
    # the disk512 shape: OPT-1.3B dummy weights from files, one prefill chunk of 8 x 512
    python -m benchmarks.studies.attention_ab --old-rev e51059a --model opt-1.3b --dummy-weights \
        --percent 0 0 100 0 100 0 --batch 8 --prompt-len 512 --hh-size 51 --recent-size 51 \
        --out benchmarks/results/attention_ab_disk512
"""
from __future__ import annotations

from benchmarks.studies import ab  # first: it sets OMP_WAIT_POLICY before torch loads

import inspect  # noqa: E402
import sys  # noqa: E402
from statistics import mean  # noqa: E402

OPS_PATH = "flexgen_h2o/models/ops.py"


def old_attention(rev: str):
    """grouped_attention from `rev`'s ops.py, called with the keyword arguments it knows."""
    try:
        fn = ab.module_at(rev, OPS_PATH, "ops_old").grouped_attention
    except ImportError as exc:           # before the kernels package, ops.py imported flexgen_h2o.models.fused
        raise SystemExit(f"error: {rev}'s ops.py does not import in this tree ({exc}); pick a later revision")
    known = set(inspect.signature(fn).parameters)
    return lambda *args, **kw: fn(*args, **{k: v for k, v in kw.items() if k in known})


def ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """Per case, mean old time / mean new time (> 1: the new function is faster)."""
    cases = {key.rsplit("-", 1)[0] for key in times}
    return {c: mean(times[f"{c}-old"]) / mean(times[f"{c}-new"]) for c in sorted(cases)}


def main(argv: list[str] | None = None) -> int:
    p = ab.parser("attention_ab", __doc__)
    side = p.add_mutually_exclusive_group(required=True)
    ab.add_old_rev(side, "grouped_attention", required=False)
    side.add_argument("--compiled", action="store_true",
                      help="baseline: the torch-op path; new: the compiled prompt attention")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--hh-size", type=int, default=204)
    p.add_argument("--recent-size", type=int, default=204)
    p.add_argument("--dummy-weights", action="store_true", help="as profile_decode's (the OPT shapes)")
    p.add_argument("--percent", type=int, nargs=6, metavar="P", help="as profile_decode's (placement)")
    ab.add_common(p, "benchmarks/results/attention_ab", repeats=2)
    a = p.parse_args(argv)
    a.device = "cpu"                                          # what profile_decode.setup reads besides these
    from benchmarks.studies.profile_decode import setup
    from flexgen_h2o.config import GenerationConfig
    from flexgen_h2o.kernels import Kernels, build
    from flexgen_h2o.models import ops
    plain = ops.grouped_attention
    if a.compiled:
        if ab.kernels_missing():
            return 2
        versions = {"old": plain, "new": plain}
        kernels = {"old": Kernels(None), "new": Kernels(build.load())}
    else:
        versions = {"old": old_attention(a.old_rev), "new": plain}
        kernels = {"old": Kernels(None), "new": Kernels(None)}
    _, engine, prompts, rules = setup(a)
    gen = GenerationConfig(max_new_tokens=1, stop_at_eos=False)
    try:
        engine.generate(prompts, gen, eviction=rules["full"])                      # warm-up

        def use(ver: str) -> None:
            ops.grouped_attention = versions[ver]
            engine.kernels = kernels[ver]

        times = ab.run_interleaved(
            ("full", "h2o"), {"old": lambda: use("old"), "new": lambda: use("new")}, a.repeats,
            lambda case: engine.generate(prompts, gen, eviction=rules[case]).metrics["prefill_s"],
            lambda case, ver, s: f"{case:5s} {ver}: prompt pass {s:.2f} s")
    finally:
        ops.grouped_attention = plain
        engine.close()
    result = {"args": ab.args_json(a), "prefill_s": times, "old_over_new": ratios(times)}
    ab.write_ab(a.out, result, "old_over_new",
                lambda case, r: f"{case}: old {mean(times[case + '-old']):.2f} s, "
                                f"new {mean(times[case + '-new']):.2f} s (mean of {a.repeats}): {r:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
