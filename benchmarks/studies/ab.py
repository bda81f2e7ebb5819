"""The shared A/B runner of the studies: what every comparison of two (or more) versions of one piece of code
needs, so that each study declares only its own shape flags and its sides.

- flags: `add_common` gives --repeats, --threads, --out and, where asked, --base REV; `add_old_rev` gives
  --old-rev REV (the studies that swap in one old Python function);
- the other revision: `module_at` loads one file of it beside the working tree's module, `kernels_at` builds
  its compiled kernels beside the working tree's (neither touches the checkout: `git show` / `git archive`) and
  gives them as a `flexgen_h2o.kernels.Kernels`, the object an engine's layers call (a side is a Kernels set on
  the engine, `engine.kernels = ...`, before its run);
- the interleaved order: `time_interleaved` times in-process calls A B C, then C B A, ...; `run_interleaved`
  does the same for engine runs, per case, with a side's setup before each run;
- the output: `args_json` and `timing_summary` build the JSON, `write_ab` / `write_timings` write
  out/results.json (atomically) and print one line per case.

A study imports this module before anything that loads torch: it sets OMP_WAIT_POLICY first.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any, Callable, Sequence, TypeVar  # noqa: E402

from benchmarks.common import REPO_ROOT, median  # noqa: E402

T = TypeVar("T")


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The study's parser: `python -m benchmarks.studies.<name>`, described by its docstring's first paragraph."""
    return argparse.ArgumentParser(prog=f"python -m benchmarks.studies.{name}", description=doc.split("\n\n")[0])


def add_common(p: argparse.ArgumentParser, out: str, repeats: int, base: str | None = None) -> None:
    """The flags every A/B shares: timed repeats, torch threads, the output folder, and --base REV where `base`
    (its help, which says what the other revision's side is) is given."""
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--threads", type=int, default=2)
    if base is not None:
        p.add_argument("--base", metavar="REV", help=base)
    p.add_argument("--out", type=Path, default=Path(out))


def add_old_rev(p: argparse._ActionsContainer, what: str, required: bool = True) -> None:
    """--old-rev REV: the git revision whose `what` is the baseline (p may be a mutually exclusive group)."""
    p.add_argument("--old-rev", required=required, help=f"git revision whose {what} is the baseline")


def args_json(a: argparse.Namespace) -> dict[str, str]:
    """The parsed flags as the results.json of every study records them."""
    return {k: str(v) for k, v in vars(a).items()}


def module_at(rev: str, path: str, name: str) -> ModuleType:
    """The module at `path` as it was at git revision `rev`, loaded under `name` beside the working tree's (an
    A/B of an old function against the new one in one process)."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / f"{name}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


CSRC_FOLDERS = ("flexgen_h2o/kernels/csrc", "flexgen_h2o/models/csrc")   # where a revision keeps them (newest first)


def kernels_at(rev: str) -> Any:
    """The compiled kernels as they were at git revision `rev` (a `Kernels` whose calls go to that build), built
    under another extension name beside the working tree's (an A/B of a kernel change in one process)."""
    from flexgen_h2o.kernels import build
    # keyed by the commit, not the name: HEAD or a branch names other sources once it moves
    commit = subprocess.run(["git", "rev-parse", "--short=12", f"{rev}^{{commit}}"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()
    csrc = next((c for c in CSRC_FOLDERS if subprocess.run(["git", "cat-file", "-e", f"{commit}:{c}"],
                                                           cwd=REPO_ROOT, capture_output=True).returncode == 0),
                None)
    if csrc is None:
        raise SystemExit(f"error: revision {rev} has no compiled kernels (none of {', '.join(CSRC_FOLDERS)})")
    build_dir = Path(tempfile.gettempdir()) / f"flexgen_h2o_csrc_{commit}"
    folder = build_dir / csrc
    if not folder.is_dir():                           # extracted beside it, then renamed: whole or absent
        staging = tempfile.mkdtemp(dir=build_dir.parent, prefix=build_dir.name + ".")
        try:
            archive = subprocess.run(["git", "archive", commit, csrc], cwd=REPO_ROOT, capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", staging], input=archive, check=True)
            os.rename(staging, build_dir)
        except OSError:
            if not folder.is_dir():                   # not another process extracting the same commit first
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return older_kernels(build.jit_build(sorted(folder.glob("*.cpp")), "_" + commit))


def older_kernels(ext: Any) -> Any:
    """A `Kernels` over an older revision's build, adapted where that build took less: a RoPE kernel of one
    token only (its prompts keep the torch ops) and a commit of one budget per block (ints)."""
    from flexgen_h2o.kernels import Kernels
    from flexgen_h2o.models import ops

    class OlderKernels(Kernels):
        def apply_rope(self, x, cos, sin):
            if x.dim() == 4 and x.shape[2] > 1 and not getattr(self.ext, "rope_rows_takes_prompts", False):
                return ops.apply_rope(x, cos, sin)
            return super().apply_rope(x, cos, sin)

        def commit_step(self, *args):
            if getattr(self.ext, "commit_takes_row_budgets", False):
                return self.ext.commit_step(*args)
            *head, recent, budget = args
            if len(set(recent.tolist())) > 1 or len(set(budget.tolist())) > 1:
                raise SystemExit("error: the older build's commit takes one budget per block; these rows differ")
            return self.ext.commit_step(*head, int(recent[0]), int(budget[0]))

    return OlderKernels(ext)


def kernels_missing() -> bool:
    """True, after one error line saying why, where the compiled CPU kernels cannot be loaded: a study that
    times them then exits 2."""
    from flexgen_h2o.kernels import build
    if os.environ.get(build.OFF_SWITCH, "1") != "0" and build.load() is not None:
        return False
    why = build.unavailable_reason() or f"switched off by {build.OFF_SWITCH}=0"
    print(f"error: the compiled kernels are unavailable ({why}); `make install` builds them with a C++ compiler "
          "and ninja", file=sys.stderr)
    return True


def kernels_ready(threads: int) -> bool:
    """The start of a study that times the compiled kernels: False (after kernels_missing's error line) where
    they cannot be loaded, else torch's threads set to `threads`."""
    if kernels_missing():
        return False
    import torch
    torch.set_num_threads(threads)
    return True


def alternating(names: Sequence[T], rep: int) -> list[T]:
    """The sides' order in repeat `rep`: as given on even repeats, reversed on odd ones, so the VM's drift lands
    on every side alike."""
    return list(names) if rep % 2 == 0 else list(names)[::-1]


def time_interleaved(run: dict[str, Callable[[], object]], repeats: int, calls: int = 1) -> dict[str, list[float]]:
    """ms per call of each case, `calls` calls per timed block, in the order A B C, then C B A, ...: in-process
    micro-benchmarks see the VM's drift alike."""
    times: dict[str, list[float]] = {name: [] for name in run}
    for rep in range(repeats):
        for name in alternating(list(run), rep):
            start = time.perf_counter()
            for _ in range(calls):
                run[name]()
            times[name].append(1e3 * (time.perf_counter() - start) / calls)
    return times


def run_interleaved(cases: Sequence[str], sides: dict[str, Callable[[], object]], repeats: int,
                    measure: Callable[[str], float], line: Callable[[str, str, float], str]) -> dict[str, list[float]]:
    """Per repeat and case, each side in alternating order: its setup (sides[side]()), then measure(case), which
    returns the figure kept under "<case>-<side>"; line(case, side, figure) is printed after each."""
    figures: dict[str, list[float]] = {}
    for rep in range(repeats):
        for case in cases:
            for side in alternating(list(sides), rep):
                sides[side]()
                figure = measure(case)
                figures.setdefault(f"{case}-{side}", []).append(figure)
                print(line(case, side, figure), flush=True)
    return figures


def timing_summary(times: dict[str, list[float]], baseline: str) -> dict:
    """The timings, their medians and each case's median over the baseline's, as the JSON of a micro-benchmark."""
    med = {name: median(ts) for name, ts in times.items()}
    return {"ms_per_layer": times, "median_ms": med, f"over_{baseline}": {n: med[n] / med[baseline] for n in med}}


def write_result(out: Path, result: dict) -> None:
    """out/results.json, written atomically (a kill never leaves half a file)."""
    from flexgen_h2o.eval.results import write_text_atomic
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(result, indent=2))


def write_ab(out: Path, result: dict, ratio_key: str, line: Callable[[str, Any], str]) -> None:
    """Write an A/B run's result to out/results.json and print line(case, value) for each case of
    result[ratio_key]."""
    write_result(out, result)
    for case, ratio in result[ratio_key].items():
        print(line(case, ratio))


def write_timings(out: Path, result: dict, baseline: str, title: str, digits: int = 3) -> None:
    """Write a timing_summary result to out/results.json and print its medians in one line."""
    write_result(out, result)
    med, ratio = result["median_ms"], result[f"over_{baseline}"]
    print(f"{title}: " + ", ".join(f"{n} {med[n]:.{digits}f} ms ({ratio[n]:.2f}x)" for n in med))
