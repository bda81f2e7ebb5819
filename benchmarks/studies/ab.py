"""The A/B runner: what a comparison of two versions of the code in one process needs (engine_ab.py).

- flags: `add_common` gives --repeats, --threads, --out and, where asked, --base REV;
- the kernels: `CSRC_FOLDERS` (where a revision keeps their sources; scripts/same_outputs.py reads it too),
  `kernels_ready` (exit 2 with one line where they cannot be loaded);
- the interleaved order: `run_interleaved` runs the sides A B, then B A, ..., per case, with a side's setup before
  each run, so the VM's drift lands on both alike;
- the output: `args_json` builds the JSON, `write_ab` writes out/results.json (atomically) and prints one line
  per case.

A study imports this module before anything that loads torch: it sets OMP_WAIT_POLICY first.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")     # before torch loads OpenMP

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Sequence, TypeVar  # noqa: E402


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


def args_json(a: argparse.Namespace) -> dict[str, str]:
    """The parsed flags as the results.json of every study records them."""
    return {k: str(v) for k, v in vars(a).items()}


CSRC_FOLDERS = ("flexgen_h2o/kernels/csrc", "flexgen_h2o/models/csrc")   # where a revision keeps them (newest first)


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
