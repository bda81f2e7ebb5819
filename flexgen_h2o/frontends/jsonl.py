"""Batch JSONL in and out: block-by-block atomic appends, resume by id, input order.

Input: one JSON object per line, in one of the forms parsed (strictly, with line numbers) by
frontends/requests.py: `prompt` (raw text) or `messages` (a chat) lines, or OpenAI Batch API request lines.
Output: one line per input, in the form of its input (requests.record).
During a run each finished block is appended with a single write() of whole lines and fsync'd, so a crash
(even SIGKILL) leaves only whole lines, in completion (bucket) order. When every id is done the file is
rewritten in input order through a temporary file and an atomic rename. Rerunning with the same output skips
the ids already there; a torn last line (power loss mid-write) is dropped and redone.
Stdlib only: the CLI reads and checks everything here before importing torch.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable

from flexgen_h2o.config import ConfigError
from flexgen_h2o.files import real_path
# read_requests is re-exported: callers import the batch file's reader from here
from flexgen_h2o.frontends.requests import Request, read_requests, record, result_key, same_request  # noqa: F401
# OutputWriteError is re-exported: the output's own errors are named from here
from flexgen_h2o.frontends.settings import OutputWriteError, check_settings, save_settings


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """Fail early, writing nothing, when `path` cannot be created or replaced."""
    p = real_path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a directory")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {parent} does not exist")
    _probe_write(parent, flag, path)
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{flag} {path} is not writable")


def check_folder_writable(path: str | os.PathLike, flag: str) -> None:
    """A folder that may not exist yet: its nearest existing ancestor must be a writable folder. Creates
    nothing (the engine makes the folder when it runs)."""
    p = Path(path).expanduser().absolute()
    anc = p
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(f"{flag} {path}: {anc} is not a folder")
    _probe_write(anc, flag, path)


def _probe_write(folder: Path, flag: str, path: str | os.PathLike) -> None:
    """Create and remove a file in `folder`: permission bits say nothing for root or a read-only mount."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path} is not writable: {e.strerror or e}") from None


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ResultsFile:
    """The output JSONL: what is done already, appends per block, and the final reorder."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False, settings: dict | None = None):
        self.path = Path(path).expanduser()      # as the user named it, for messages
        self.target = real_path(path)            # the file written and replaced (a symlink's target)
        self.done: dict[str, dict] = {}          # id key -> record, from earlier runs and this one
        self.repaired = False                    # a torn last line was dropped
        # --overwrite: an old file is truncated by the first block written, not before: an error before
        # any result leaves it untouched
        self._truncate_first = overwrite
        # the settings that change answers (frontends/settings.py): checked against the recorded ones when
        # there are results to resume, and recorded before the first line this run writes
        self.settings = settings
        self._settings_saved = settings is None

    def load(self, requests: list[Request]) -> int:
        """Read an existing output (resume). Returns how many of `requests` are done. Lines must belong to this
        input: an id that is not in it, or a different prompt for the same id, stops the run."""
        if self._truncate_first or not self.target.exists():
            return 0
        raw = self.target.read_bytes()
        if raw and not raw.endswith(b"\n"):      # torn tail: our appends never do this, a power cut might
            raw = raw[:raw.rfind(b"\n") + 1]
            self.repaired = True
        by_key, foreign = {r.key: r for r in requests}, ""
        for n, line in enumerate(raw.split(b"\n")[:-1], start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = result_key(rec)
            except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError):
                raise ConfigError(f"--output {self.path}: line {n} is not a result line; not resuming over it "
                                  "(move the file away or pass --overwrite)") from None
            req = by_key.get(key)
            if req is None:
                raise ConfigError(f"--output {self.path}: line {n} has id {key}, which is not in the input; "
                                  "use another --output or pass --overwrite")
            if not same_request(rec, req):
                what = "request line" if req.url else "prompt or max_new_tokens"
                foreign = foreign or (f"--output {self.path}: id {key} (line {n}) was generated for a different "
                                      f"{what}; use another --output or pass --overwrite")
            self.done.setdefault(key, rec)
        if self.done and self.settings is not None:      # first: other settings (--gen-len) say more than a line
            self._settings_saved = check_settings(self.path, self.settings)
        if foreign:
            raise ConfigError(foreign)
        if self.repaired:
            self._truncate(len(raw))
        return sum(1 for r in requests if r.key in self.done)

    def _truncate(self, size: int) -> None:
        with open(self.target, "r+b") as f:
            f.truncate(size)
            os.fsync(f.fileno())

    def append(self, records: Iterable[dict]) -> None:
        """Append whole lines with one write() and fsync them: a kill leaves the block in full or not at all. A
        write that fails (a full disk) is cut back to the last whole line and raised as OutputWriteError."""
        recs = list(records)
        data = b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in recs)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if self._truncate_first else 0)
        try:
            fd = os.open(self.target, flags, 0o644)
        except OSError as e:
            raise self._write_error(e) from None
        self._truncate_first = False
        try:
            if not self._settings_saved:
                # after the truncation an --overwrite asked for and before the first line: the file never holds
                # a line next to settings it was not made with
                save_settings(self.path, self.settings)
                self._settings_saved = True
            start = os.fstat(fd).st_size      # the lock holder is the only writer: the end of the last whole line
            try:
                view, written = memoryview(data), 0
                while written < len(data):   # a regular file takes it in one go; loop only for safety
                    written += os.write(fd, view[written:])
                os.fsync(fd)
            except OSError as e:
                try:
                    os.ftruncate(fd, start)  # no torn line: the rerun would drop it, but the promise is whole lines
                    os.fsync(fd)
                except OSError:
                    pass
                raise self._write_error(e) from None
        finally:
            os.close(fd)
        for r in recs:
            self.done[result_key(r)] = r

    def _write_error(self, e: OSError) -> OutputWriteError:
        """One line naming the file and the way on: every line already in it is whole and is kept."""
        if isinstance(e, OutputWriteError):
            return e
        why = e.strerror or str(e)
        return OutputWriteError(f"cannot write {self.path}: {why}; the lines already in it are whole and kept: "
                                "make room (or fix the cause) and rerun the same command to resume the job")

    def finalize(self, requests: list[Request]) -> None:
        """Rewrite the file in input order (temporary file, fsync, atomic rename)."""
        missing = [r.id for r in requests if r.key not in self.done]
        if missing:
            raise RuntimeError(f"ids {missing[:5]} have no result")
        data = b"".join(json.dumps(self.done[r.key], ensure_ascii=False).encode("utf-8") + b"\n"
                        for r in requests)
        # beside the target and renamed onto it: a symlinked output keeps its link
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.target.name}.", suffix=".tmp", dir=self.target.parent)
        except OSError as e:
            raise self._write_error(e) from None
        try:
            os.fchmod(fd, 0o644)             # mkstemp's 0600 would make the rewritten output private to its owner
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.target)
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(e, OSError):       # the old file is untouched: a rerun finds every line again
                raise self._write_error(e) from None
            raise
        _fsync_dir(self.target.parent)


class OutputLock:
    """`<output>.lock`, flock'd for the whole run, so a second run on the same output is refused instead of
    interleaving its appends. The kernel drops a flock when its process dies, however it dies: a killed run's
    leftover lock file never blocks the rerun that resumes it."""

    def __init__(self, output: str | os.PathLike):
        self.output = Path(output).expanduser()
        real = real_path(output)             # an alias (symlink) of an output takes that output's lock
        self.path = real.with_name(real.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> "OutputLock":
        """Take the lock or raise ConfigError naming the output, the lock file and the holder's pid."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                os.close(fd)
                by = f"pid {holder}" if holder.isdigit() else "another process"
                raise ConfigError(f"--output {self.output} is in use by another run ({by} holds {self.path}); "
                                  "wait for it to finish or pick another --output") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                print(f"warning: cannot lock {self.path} ({e.strerror}); a second run on this --output would not "
                      "be refused", file=sys.stderr)
                return self
            # the previous holder may have removed the file between our open and flock: lock the file that is there
            try:
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())     # for the refusal message only; the flock is the lock
        self._fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file, then drop the lock: in this order nobody can lock a file that is about to go."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def generate_file(llm: Any, requests: list[Request], pending: list[Request], ids: list[list[int]],
                  results: ResultsFile, gen: Any, *, input_name: str, progress: bool, job: Any = None) -> dict:
    """Generate the pending requests, appending results as they finish; then put the whole file in input
    order. Synchronous blocks (bucketed) append block by block; a refilled job (llm.refill: prompts join in
    input order) holds each finished result until every earlier pending id is written, so the file stays in
    input order all along. Returns the run's metrics (times and token counts)."""
    # sampling seeded by the request's place in the input (as LLM.generate seeds by list index), not by its
    # place in this run: a resumed id samples what it would have sampled uninterrupted
    position = {r.key: n for n, r in enumerate(requests)}
    blocks = llm.generate_blocks(ids, gen, [r.max_new_tokens for r in pending], progress=progress,
                                 label=lambda i: f"{input_name}: line {pending[i].line}",
                                 seeds=[position[r.key] for r in pending], job=job)
    held: dict[int, dict] = {}
    next_out = 0                                     # the first pending index not yet written (refill)
    for block in blocks:
        recs = {i: record(pending[i], text, toks, reason, len(ids[i]), model=llm.config.name)
                for i, toks, text, reason in zip(block.indices, block.token_ids, block.texts, block.finish_reasons)}
        if not llm.refill:
            results.append(recs.values())
            continue
        held.update(recs)
        run = []
        while next_out in held:
            run.append(held.pop(next_out))
            next_out += 1
        if run:
            results.append(run)
    results.finalize(requests)                       # raises if any id were still held (none is: all finish)
    return dict(llm.last_metrics)
