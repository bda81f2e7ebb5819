"""A batch job under torchrun: its shared start, each rank's part file, and rank 0's merge into the output.

Data-parallel, every rank runs its own engine on a share of the prompts; in a pipeline, the last stage writes.
Rank 0 takes the output's lock, reads the input once and collects what is done already: the output's lines and
the lines of every part file left by an earlier run, whatever its world size. Every rank gets the same requests
and done ids, tokenizes the pending prompts and takes its share (distributed/shard.py: balanced by tokens). A
rank appends its finished blocks to its own part, `<output>.rank<R>.part`, one fsync'd write per block (a kill
leaves whole lines only). When every rank is done, rank 0 merges output and parts into the output in input
order (temporary file, atomic rename) and removes the parts. A rerun after a failure, with any number of ranks,
resumes from the output and all parts: nothing is lost or generated twice.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from flexgen_h2o.config import ConfigError
from flexgen_h2o.distributed.shard import prompt_work, shard_by_tokens
from flexgen_h2o.distributed.world import World
from flexgen_h2o.files import real_path
from flexgen_h2o.frontends.jsonl import OutputLock, ResultsFile
from flexgen_h2o.frontends.requests import Request
from flexgen_h2o.frontends.settings import check_settings, remove_settings, save_settings


class QuietExit(ConfigError):
    """Rank 0 failed a check every rank shares and printed it; the other ranks stop without a second line."""


def part_path(output: str | os.PathLike, rank: int) -> Path:
    out = real_path(output)          # beside the real file: an alias of the output finds the same parts
    return out.with_name(f"{out.name}.rank{rank}.part")


def existing_parts(output: str | os.PathLike) -> list[Path]:
    """Part files of this output from any run, any world size."""
    out = real_path(output)
    return sorted(Path(p) for p in glob.glob(os.path.join(glob.escape(str(out.parent)),
                                                          glob.escape(out.name) + ".rank*.part")))


def collect_done(output: str | os.PathLike, requests: list[Request], *, overwrite: bool,
                 merged: ResultsFile | None = None) -> ResultsFile:
    """The output's results and every part's, checked against the input as a resume checks them (an id that is
    not in it, or another prompt under the same id, is refused); a part's line wins over the output's. merged:
    the output already read (the job's start), to which the parts are added again."""
    if merged is None:
        merged = ResultsFile(output, overwrite=overwrite)
        merged.load(requests)
    for part in existing_parts(output):
        rf = ResultsFile(part)
        rf.load(requests)
        merged.done.update(rf.done)
    return merged


class RankPart(ResultsFile):
    """This rank's results: appended to its part file; finalize() waits for every rank, then rank 0 merges."""

    def __init__(self, job: "DistributedJob"):
        super().__init__(part_path(job.output, job.world.rank))
        self.job = job

    def finalize(self, requests: list[Request]) -> None:
        self.job.finish(requests)


class NullPart(RankPart):
    """A pipeline stage before the last: it generates no text of its own; it waits for the end like the rest."""

    def append(self, records: Any) -> None:
        pass


class DistributedJob:
    """The job's shared start (rank 0 reads, everyone gets the same view) and its end (gather, then merge)."""

    def __init__(self, world: World, output: str, *, overwrite: bool,
                 read: Callable[[], list[Request]], settings: dict | None = None):
        self.world, self.output, self.overwrite = world, output, overwrite
        self.settings = settings             # what changes answers (frontends/settings.py), checked as one run
        self._read = read
        self.lock: OutputLock | None = None
        self._merged: ResultsFile | None = None      # rank 0: what was done at the start
        self.requests: list[Request] = []
        self.done: set[str] = set()
        self.resumed_parts = 0

    def __enter__(self) -> "DistributedJob":
        start: dict[str, Any] = {}
        if self.world.is_main:
            try:
                self.lock = OutputLock(self.output).acquire()
                requests = self._read()
                if self.overwrite:       # the job starts afresh: no earlier result may count at a resume
                    for part in existing_parts(self.output):
                        part.unlink()
                    real_path(self.output).unlink(missing_ok=True)      # a symlinked output keeps its link
                    remove_settings(self.output)
                self._merged = merged = collect_done(self.output, requests, overwrite=self.overwrite)
                # the output's and every part's results were made with the recorded settings: a rerun with
                # others is refused, as one process's is; the record is in place before any rank appends
                if self.settings is not None and not (merged.done and check_settings(self.output,
                                                                                      self.settings)):
                    save_settings(self.output, self.settings)
                start = dict(requests=requests, done=sorted(merged.done),
                             parts=len(existing_parts(self.output)))
            except (ConfigError, OSError) as e:    # every rank must hear it, or they wait forever
                start = dict(error=str(e))
        start = self.world.broadcast(start)
        if "error" in start:
            self._release()
            if self.world.is_main:
                raise ConfigError(start["error"])
            raise QuietExit(start["error"])
        self.requests, self.done, self.resumed_parts = start["requests"], set(start["done"]), start["parts"]
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release()

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def pending(self) -> list[Request]:
        return [r for r in self.requests if r.key not in self.done]

    def share(self, prompt_tokens: Sequence[int], max_new: Sequence[int]) -> list[int]:
        """Indices (into the pending list) of the prompts this rank generates."""
        work = [prompt_work(p, n) for p, n in zip(prompt_tokens, max_new)]
        return shard_by_tokens(work, self.world.size)[self.world.rank]

    def finish(self, requests: list[Request]) -> None:
        """Wait for every rank, then rank 0 writes the output in input order."""
        if self.world.is_main and self.world.size > 1:    # a long wait is not a silent one
            print(f"rank 0 has written its share; waiting for the other {self.world.size - 1} rank(s)", flush=True)
        self.world.gather(None)
        if not self.world.is_main:
            return
        # the output is as it was at the start: only the parts are read again
        merged = collect_done(self.output, requests, overwrite=self.overwrite, merged=self._merged)
        merged.finalize(requests)                 # raises, naming the ids, if any rank's share is missing
        for part in existing_parts(self.output):
            part.unlink()


def job_summary(per_rank: list[dict]) -> str:
    """Rank 0's line for the whole job: its throughput is the slowest rank's wall time over every token."""
    tokens = sum(m.get("generated_tokens", 0) for m in per_rank)
    wall = max((m.get("total_s", 0.0) for m in per_rank), default=0.0)
    ranks = " | ".join(f"{r}: {m.get('prompts', 0)} prompts, {m.get('prompt_tokens', 0)} + "
                       f"{m.get('generated_tokens', 0)} tokens, {m.get('total_s', 0.0):.1f} s"
                       for r, m in enumerate(per_rank))
    return (f"data-parallel: {len(per_rank)} ranks, {tokens} tokens generated in {wall:.1f} s (the slowest "
            f"rank) = {tokens / max(wall, 1e-9):.1f} tok/s  [{ranks}]")
