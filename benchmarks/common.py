"""Shared helpers for the benchmark scripts: one environment for every case, one subprocess per case, interleaved
repeats, and a cold page cache without root.

Every case runs `python -m flexgen_h2o.run ... --metrics-json F` in its own process, so peak RSS (ru_maxrss) and
the allocator state belong to that case alone; the parent only reads the JSON back. The studies' A/B helpers
(another revision's code, alternating order, results.json) are in benchmarks/studies/ab.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
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
