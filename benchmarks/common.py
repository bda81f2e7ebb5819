"""Shared helpers for the benchmark scripts: one environment for every case, one subprocess per case, interleaved
repeats, and a cold page cache without root.

Every case runs `python -m flexgen_h2o.run ... --metrics-json F` in its own process, so peak RSS (ru_maxrss) and
the allocator state belong to that case alone; the parent only reads the JSON back.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

from flexgen_h2o.memory import drop_file_cache

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
T = TypeVar("T")


class CaseFailed(RuntimeError):
    """A benchmark subprocess exited non-zero; the message carries its last output lines."""


def bench_env(threads: int = 2) -> dict[str, str]:
    """The same environment for every case: passive OpenMP waits (spinning threads starve the other case's
    process and other tenants on a shared VM), a fixed thread count (torch reads OMP_NUM_THREADS at start-up),
    and offline Hugging Face libraries (no network lookups inside timed runs)."""
    env = dict(os.environ)
    env.update(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p))
    return env


def run_json(args: Sequence[str], json_path: str | os.PathLike, *, env: dict[str, str] | None = None,
             log_path: str | os.PathLike | None = None, timeout: float | None = None) -> dict:
    """Run `python <args>` from the repo root, keep its output in `log_path`, return the JSON it wrote.

    The JSON file is removed first so a stale result from an earlier run can never be read back by mistake."""
    json_path = Path(json_path)
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env or bench_env(), capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if log_path is not None:
        Path(log_path).write_text(" ".join(cmd) + "\n\n" + out)
    if proc.returncode != 0 or not json_path.is_file():
        tail = "\n".join(out.strip().splitlines()[-15:])
        raise CaseFailed(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")
    data = json.loads(json_path.read_text())
    data["subprocess_wall_s"] = wall
    return data


def interleaved(cases: Sequence[T], repeats: int) -> list[tuple[int, T]]:
    """A B A B ... order: slow drift of the machine (other tenants, thermal state) hits every case alike."""
    return [(r, c) for r in range(repeats) for c in cases]


def time_interleaved(run: dict[str, Callable[[], object]], repeats: int, calls: int = 1) -> dict[str, list[float]]:
    """ms per call of each case, `calls` calls per timed block, in the order A B C, then C B A, ...: in-process
    micro-benchmarks see the VM's drift alike."""
    names = list(run)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            for _ in range(calls):
                run[name]()
            times[name].append(1e3 * (time.perf_counter() - start) / calls)
    return times


def timing_summary(times: dict[str, list[float]], baseline: str) -> dict:
    """The timings, their medians and each case's median over the baseline's, as the JSON of a micro-benchmark."""
    med = {name: median(ts) for name, ts in times.items()}
    return {"ms_per_layer": times, "median_ms": med, f"over_{baseline}": {n: med[n] / med[baseline] for n in med}}


def write_timings(out: Path, result: dict, baseline: str, title: str, digits: int = 3) -> None:
    """Write a timing_summary result to out/results.json (atomically) and print its medians in one line."""
    from flexgen_h2o.eval.results import write_text_atomic
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(result, indent=2))
    med, ratio = result["median_ms"], result[f"over_{baseline}"]
    print(f"{title}: " + ", ".join(f"{n} {med[n]:.{digits}f} ms ({ratio[n]:.2f}x)" for n in med))


def kernels_missing() -> bool:
    """True, after one error line saying why, where the compiled CPU kernels cannot be loaded: a benchmark that
    times them then exits 2."""
    from flexgen_h2o.models import fused
    if fused.module() is not None:
        return False
    why = fused.unavailable_reason() or f"switched off by {fused.ENV_SWITCH}=0"
    print(f"error: the compiled kernels are unavailable ({why}); `make install` builds them with a C++ compiler "
          "and ninja", file=sys.stderr)
    return True


def write_ab(out: Path, result: dict, ratio_key: str, line: Callable[[str, float], str]) -> None:
    """Write an A/B run's result to out/results.json (atomically) and print line(case, ratio) for each case of
    result[ratio_key]."""
    from flexgen_h2o.eval.results import write_text_atomic
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(result, indent=2))
    for case, ratio in result[ratio_key].items():
        print(line(case, ratio))


def drop_page_cache(files: Iterable[str | os.PathLike]) -> tuple[int, int]:
    """Evict the files' pages from the OS page cache so the next read comes from the device.

    fsync first (dirty pages cannot be dropped), then posix_fadvise(POSIX_FADV_DONTNEED) over the whole file.
    Needs no root, unlike `echo 1 > /proc/sys/vm/drop_caches`, and touches only these files. Pages still
    mapped by a live process stay resident, so call it between runs. Returns (files, bytes) advised."""
    sizes = [drop_file_cache(path) for path in files]
    return len(sizes), sum(sizes)


def batch_steps(max_batch: int) -> list[int]:
    """Batch sizes a search tries, ascending: every size to 16, then every 2nd to 64, then every 4th."""
    out, b = [], 1
    while b <= max_batch:
        out.append(b)
        b += 1 if b < 16 else 2 if b < 64 else 4
    return out


def largest_batch(predict: Callable[[int], int], budget: int, max_batch: int) -> tuple[int, list[tuple[int, int]]]:
    """The largest batch whose predicted bytes fit `budget` (predictions grow with the batch, so the first
    batch over budget ends the scan). Returns (that batch or 0, [(batch, predicted bytes)] as scanned)."""
    best, seen = 0, []
    for b in batch_steps(max_batch):
        seen.append((b, predict(b)))
        if seen[-1][1] > budget:
            break
        best = b
    return best, seen


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def rss_parts() -> dict[str, int]:
    """This process's resident set now, from /proc/self/statm (one cheap read): "rss" in all, "file" the pages
    backed by a file or shared memory (RssFile + RssShmem: mapped libraries, np.memmap'd weights; the kernel can
    drop them) and "anon" the rest (heap, tensors). Empty where the kernel does not expose it."""
    try:
        with open("/proc/self/statm") as f:
            resident, shared = (int(x) * PAGE_SIZE for x in f.read().split()[1:3])
    except (OSError, ValueError):
        return {}
    return {"rss": resident, "file": shared, "anon": resident - shared}


class RssSampler:
    """Peaks of each rss_parts() value, sampled on a daemon thread (torch ops release the GIL), plus the values
    at the start. VmHWM keeps only the total's peak, and the total misleads where a process maps its weight
    files: those pages count in its RSS, while a process that read() the same files is not charged for them."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.start: dict[str, int] = {}
        self.peaks: dict[str, int] = {}
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def peak(self) -> int:
        return self.peaks.get("rss", 0)

    def growth(self, key: str) -> int:
        """How far a part's peak rose above its value at the start."""
        return self.peaks.get(key, 0) - self.start.get(key, 0)

    def _sample(self) -> None:
        for key, value in rss_parts().items():
            self.peaks[key] = max(self.peaks.get(key, 0), value)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def __enter__(self) -> "RssSampler":
        self.start = rss_parts()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def module_at(rev: str, path: str, name: str):
    """The module at `path` as it was at git revision `rev`, loaded under `name` beside the working tree's (the
    A/B benchmarks time an old function against the new one in one process)."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / f"{name}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def kernels_at(rev: str):
    """The compiled kernels (flexgen_h2o/models/csrc) as they were at git revision `rev`, built under another
    extension name beside the working tree's (an A/B of a kernel change in one process)."""
    from flexgen_h2o.models import fused
    csrc = fused.CSRC.relative_to(REPO_ROOT)
    # keyed by the commit, not the name: HEAD or a branch names other sources once it moves
    commit = subprocess.run(["git", "rev-parse", "--short=12", f"{rev}^{{commit}}"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()
    build_dir = Path(tempfile.gettempdir()) / f"flexgen_h2o_csrc_{commit}"
    folder = build_dir / csrc
    if not folder.is_dir():                           # extracted beside it, then renamed: whole or absent
        staging = tempfile.mkdtemp(dir=build_dir.parent, prefix=build_dir.name + ".")
        try:
            archive = subprocess.run(["git", "archive", commit, str(csrc)], cwd=REPO_ROOT, capture_output=True,
                                     check=True).stdout
            subprocess.run(["tar", "-x", "-C", staging], input=archive, check=True)
            os.rename(staging, build_dir)
        except OSError:
            if not folder.is_dir():                   # not another process extracting the same commit first
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return fused.build(sorted(folder.glob("*.cpp")), tag="_" + commit)
