"""The whole engine of another git revision against the working tree's, in one process: the H2O prompt pass and
decode step at one shape, alternating calls (base, new, then new, base, ...), so the VM's drift, which spread
one-process-per-run pairs from 0.82x to 1.55x (benchmarks/results/ab-33-s2048/NOTES.md), lands on both alike.

The base revision's package is extracted (`git archive`) into a scratch folder under another name
(`flexgen_h2o_base`, every `flexgen_h2o` import in it renamed) and imported beside the working tree's; both load
the same weights (SmolLM2's GGUF store) and run the same prompts (Wikipedia windows). The compiled kernels must be
the same sources in both (the working tree's build is copied in); a refactor's A/B is about the Python around
them. Figures: the prompt pass (`prefill_s` of a one-token generate) and the median decode step (from one shared
prefill per side, its first two steps left out), each as new / base.

    python -m benchmarks.studies.engine_ab --base 98bf248 --batch 16 --prompt-len 2048 --hh-size 102 \
        --recent-size 102 --steps 24 --repeats 8 --out benchmarks/results/engine_ab

With --policies A,B,... the sides are eviction policies of the working tree instead, each at `--hh-ratio`'s budget
(policies that split it otherwise, such as snapkv's window, keep the same total; `snapkv-adaptive` is snapkv with
--head-budgets adaptive), each from its own prefill
(its score window's), and the figures are each policy over the first:

    python -m benchmarks.studies.engine_ab --policies h2o,snapkv,tova --hh-ratio 0.1 --batch 16 \
        --prompt-len 2048 --steps 24 --repeats 8 --out benchmarks/results/policy_ab

`full` and `pages` (page selection reading 2 x --hh-ratio of each sequence; `pages-bound` with Quest's bound) are
sides too: `--policies full,pages --cases decode` times the decode step alone.
"""
from __future__ import annotations

from benchmarks.studies import ab  # first: it sets OMP_WAIT_POLICY before torch loads

import importlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.common import REPO_ROOT, median  # noqa: E402
from flexgen_h2o.kernels import build  # noqa: E402

BASE_NAME = "flexgen_h2o_base"


def base_package(rev: str, folder: Path) -> str:
    """Extract `rev`'s flexgen_h2o into folder/BASE_NAME with its imports renamed, beside this tree's kernel
    build; returns the package name. Refuses where the kernels' sources differ (one build serves both)."""
    archive = subprocess.run(["git", "archive", rev, "flexgen_h2o"], cwd=REPO_ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    here = REPO_ROOT / ab.CSRC_FOLDERS[0]
    there = next(folder / c for c in ab.CSRC_FOLDERS if (folder / c).is_dir())
    if build.source_hash(here) != build.source_hash(there):
        raise SystemExit(f"error: {rev}'s compiled kernels differ from this tree's; this study runs both engines "
                         "on one build of them")
    for so in here.parent.glob("_kernels*.so"):
        shutil.copy(so, there.parent)
    tree = folder / BASE_NAME
    (folder / "flexgen_h2o").rename(tree)
    for py in tree.rglob("*.py"):
        py.write_text(re.sub(r"\bflexgen_h2o\.", f"{BASE_NAME}.", py.read_text()))
    return BASE_NAME


def describe_machine() -> str:
    """The CPU and the ISA the kernels were built for: every benchmark names both."""
    from flexgen_h2o.calibrate import cpu_model
    return f"{cpu_model()}; kernels built with {' '.join(build.isa_flags()) or 'no ISA flags'}"


def side(package: str, a, prompts, policy: str = "h2o"):
    """(engine, eviction rule, prefilled state) of one tree and policy."""
    engine_mod = importlib.import_module(f"{package}.engine")
    kv = importlib.import_module(f"{package}.kv")
    config = importlib.import_module(f"{package}.config")
    loader = importlib.import_module(f"{package}.loader")
    model = loader.load_model(a.model, progress=False)
    offload = config.OffloadPolicy(gpu_batch_size=a.batch, num_gpu_batches=1)
    engine = engine_mod.Engine(model.config, model.read, offload=offload, locate=model.locate)
    if a.policies:          # `snapkv-adaptive`, `pages`: as the eval grid spells them
        from flexgen_h2o.eval.grid import PAGES, base_policy
        from flexgen_h2o.kv.page_rule import PageRule
        name, adaptive = base_policy(policy)
        if name in PAGES:       # page selection reads the share an H2O cache of the same flags keeps
            rule = kv.EvictionConfig(pages=PageRule(fetch_ratio=2 * a.hh_ratio, score=PAGES[name]))
        elif name == "full":
            rule = kv.EvictionConfig()
        else:
            rule = kv.EvictionConfig(policy=name, hh_ratio=a.hh_ratio,
                                     head_budgets="adaptive" if adaptive else "uniform")
        return engine, rule, config.GenerationConfig, engine.prefill(prompts, score_window=rule.score_window)
    rule = kv.EvictionConfig(policy="h2o", hh_size=a.hh_size, recent_size=a.recent_size)
    return engine, rule, config.GenerationConfig, engine.prefill(prompts)


def main(argv: list[str] | None = None) -> int:
    p = ab.parser("engine_ab", __doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--hh-size", type=int, default=102)
    p.add_argument("--recent-size", type=int, default=102)
    p.add_argument("--steps", type=int, default=24, help="decode steps per timed call")
    p.add_argument("--policies", help="comma-separated eviction policies of this tree to compare, instead of --base "
                                      "(the first is the baseline)")
    p.add_argument("--hh-ratio", type=float, default=0.1, help="with --policies: the budget, as --hh-ratio")
    p.add_argument("--cases", default="prompt,decode", help="what to time: prompt, decode or both (page selection's "
                                                            "prompt pass is the full cache's)")
    ab.add_common(p, "benchmarks/results/engine_ab", repeats=8, base="the revision whose engine is the baseline")
    a = p.parse_args(argv)
    if bool(a.base) == bool(a.policies):
        p.error("give --base REV or --policies A,B (one of them)")
    if not ab.kernels_ready(a.threads):
        return 2
    from benchmarks.studies.step_scaling import prompts_for
    from flexgen_h2o.eval import data
    from flexgen_h2o.loader import load_model
    tokenizer = load_model(a.model, progress=False).tokenizer
    prompts = prompts_for(data.corpus_stream(tokenizer, "wiki", a.prompt_len * 2), a.batch, a.prompt_len)
    scratch = Path(tempfile.mkdtemp(prefix="engine_ab_"))
    sys.path.insert(0, str(scratch))
    sides: dict[str, tuple] = {}
    current: dict[str, tuple] = {}
    try:
        if a.policies:
            for policy in a.policies.split(","):
                sides[policy] = side("flexgen_h2o", a, prompts, policy)
        else:
            sides["base"] = side(base_package(a.base, scratch), a, prompts)
            sides["new"] = side("flexgen_h2o", a, prompts)

        def measure(case: str) -> float:
            engine, rule, gen_config, kept = current["side"]
            if case == "prompt":
                gen = gen_config(max_new_tokens=1, stop_at_eos=False)
                return engine.generate(prompts, gen, eviction=rule).metrics["prefill_s"]
            gen = gen_config(max_new_tokens=a.steps + 1, stop_at_eos=False)
            return median(engine.generate(prompts, gen, eviction=rule, prefilled=kept).metrics["step_times_s"][2:])

        cases = tuple(a.cases.split(","))
        for s in sides.values():                                   # warm-up: buffers, lazy imports, both paths
            current["side"] = s
            for case in cases:
                measure(case)
        figures = ab.run_interleaved(cases, {n: (lambda s=s: current.update(side=s))
                                                            for n, s in sides.items()},
                                     a.repeats, measure, lambda case, name, x: f"{case:6s} {name:4s}: {x:.4f} s")
    finally:
        for engine, *_ in sides.values():
            engine.close()
        shutil.rmtree(scratch, ignore_errors=True)
    base, *others = list(sides)
    ratios = {f"{case} {name}": median([n / b for n, b in zip(figures[f"{case}-{name}"], figures[f"{case}-{base}"])])
              for case in cases for name in others}
    result = {"args": ab.args_json(a), "machine": describe_machine(), "seconds": figures, "over_" + base: ratios,
              "medians_s": {k: median(v) for k, v in figures.items()}}

    def line(key: str, r: float) -> str:
        case, name = key.split()
        return (f"{case}: {name} / {base} {r:.3f} (median of {a.repeats} paired ratios; medians "
                f"{median(figures[f'{case}-{name}']):.4f} s {name}, {median(figures[f'{case}-{base}']):.4f} s {base})")
    ab.write_ab(a.out, result, "over_" + base, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
