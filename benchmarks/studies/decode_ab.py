"""Decode steps over the fp16 cache read in place: the torch-op path (ops.narrow_decode_attention) against the
compiled decode attention (kernels/csrc/decode_attention.cpp), interleaved in one process (torch, compiled, then
compiled, torch, ...), so the VM's drift lands on both alike.

Everything else is the same engine, prompts (Wikipedia windows) and cache rules as
benchmarks/studies/profile_decode.py; every call decodes from one shared prefill (Engine.prefill), so only the
decode attention differs (each side is a flexgen_h2o.kernels.Kernels set on the engine). The figure is the
median decode step of each call (its first step, which commits the kept prompt rows, left out).
`--switch layer-math` turns only csrc/layer_math.cpp off on the torch side; `--base REV` compares the working
tree's kernels with those of git revision REV instead (both compiled); `--phase prefill` times whole prompt passes
(a one-token generate each, no shared prefill) instead of decode steps.

    python -m benchmarks.studies.decode_ab --batch 120 --prompt-len 512 --out benchmarks/results/decode_ab
    # only the layer math (RMSNorm, SwiGLU's gate, RoPE: csrc/layer_math.cpp) switched, every other kernel on
    python -m benchmarks.studies.decode_ab --switch layer-math --cases h2o \
        --out benchmarks/results/decode_ab_layer_math
    # the same switch over whole prompt passes (SmolLM2, 4 x 2048)
    python -m benchmarks.studies.decode_ab --switch layer-math --phase prefill --cases h2o --batch 4 \
        --prompt-len 2048
    # a kernel change: the kernels' csrc/ as it was at 09ad2d5 (built beside the working tree's) against this tree
    python -m benchmarks.studies.decode_ab --base 09ad2d5 --cases h2o --out benchmarks/results/decode_ab_kernels
"""
from __future__ import annotations

from benchmarks.studies import ab  # first: it sets OMP_WAIT_POLICY before torch loads

import argparse  # noqa: E402
import sys  # noqa: E402

from benchmarks.common import median  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = ab.parser("decode_ab", __doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=120, help="sequences per decode step (one GPU batch)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    p.add_argument("--cases", nargs="+", default=["h2o", "full"], choices=["h2o", "h2o-avg", "full"])
    p.add_argument("--hh-size", type=int, default=204)
    p.add_argument("--recent-size", type=int, default=204)
    p.add_argument("--switch", choices=["all", "layer-math"], default="all",
                   help="what the torch side turns off: every compiled kernel, or only the layer math")
    p.add_argument("--phase", choices=["decode", "prefill"], default="decode",
                   help="prefill: time whole prompt passes (generate one token) instead of decode steps")
    ab.add_common(p, "benchmarks/results/decode_ab", repeats=3,
                  base="the other side: every compiled kernel as it was at this git revision, instead of the "
                       "torch ops (--switch is then unused)")
    return p


def sides(a: argparse.Namespace) -> dict[str, object]:
    """The two sides' kernels, baseline first: the torch ops (every compiled kernel, or only the layer math,
    off) against the compiled kernels, or REV's kernels against the working tree's."""
    from flexgen_h2o.kernels import Kernels, build
    current = Kernels(build.load())
    if a.base:
        return {f"kernels@{a.base}": ab.kernels_at(a.base), "compiled": current}
    torch_side = Kernels(None) if a.switch == "all" else Kernels(current.ext, layer_math=False)
    return {"torch": torch_side, "compiled": current}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.dummy_weights, a.percent, a.device = False, None, "cpu"     # what profile_decode.setup reads
    from benchmarks.studies.profile_decode import setup
    from flexgen_h2o.config import GenerationConfig
    if ab.kernels_missing():
        return 2
    _, engine, prompts, rules = setup(a)
    current = engine.kernels
    side_setup = {name: (lambda k=k: setattr(engine, "kernels", k)) for name, k in sides(a).items()}
    baseline = next(iter(side_setup))
    gen = GenerationConfig(max_new_tokens=a.steps + 1 if a.phase == "decode" else 1, stop_at_eos=False)
    try:
        kept = engine.prefill(prompts) if a.phase == "decode" else None
        for case in a.cases:                                    # warm-up: each rule's buffers, both sides
            for use in side_setup.values():
                use()
                engine.generate(prompts, GenerationConfig(max_new_tokens=3, stop_at_eos=False),
                                eviction=rules[case], prefilled=kept)

        def measure(case: str) -> float:
            res = engine.generate(prompts, gen, eviction=rules[case], prefilled=kept)
            # decode: the median step (0: prefill's logits; 1: the kept rows' commit); prefill: the pass
            return median(res.metrics["step_times_s"][2:]) if a.phase == "decode" else res.metrics["prefill_s"]

        steps = ab.run_interleaved(a.cases, side_setup, a.repeats, measure,
                                   lambda case, side, step: f"{case:8s} {side:8s}: {a.phase} {1e3 * step:.1f} ms")
    finally:
        engine.kernels = current
        engine.close()
    result = {"args": ab.args_json(a), "step_s": steps,
              f"{baseline}_over_compiled": {c: median(steps[f"{c}-{baseline}"]) / median(steps[f"{c}-compiled"])
                                            for c in a.cases}}
    ab.write_ab(a.out, result, f"{baseline}_over_compiled",
                lambda case, r: f"{case}: {baseline} {1e3 * median(steps[f'{case}-{baseline}']):.1f} ms, compiled "
                                f"{1e3 * median(steps[case + '-compiled']):.1f} ms a "
                                f"{'step' if a.phase == 'decode' else 'prompt pass'} "
                                f"(median of {a.repeats}): {r:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
