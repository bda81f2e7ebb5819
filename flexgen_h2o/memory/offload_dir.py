"""Offload-directory hygiene: a unique per-run folder that is removed on every way out, and a space check.

FlexGen wrote into a shared `--offload-dir` and left files behind on Ctrl-C; two runs sharing it could clobber each
other. `OffloadDir` makes `<root>/flexgen_h2o-<pid>-<random>` and removes it on normal exit, on exceptions, on
SIGINT/SIGTERM and at interpreter exit.

SIGKILL and the OOM killer leave no chance to clean up, so each run holds an flock on `<folder>/.lock` for its
lifetime (the kernel drops it when the process dies, however it dies), and a new run first removes the folders
of our naming pattern whose lock it can take: a dead run's. The lock, not the pid, decides, since pids are reused;
only a folder without a lock file (a run killed while creating it, or one made by an older version) falls back
to "its pid no longer exists". Stdlib only.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any


class OffloadDirError(OSError):
    """The offload root cannot be created or written."""


class DiskSpaceError(OffloadDirError):
    """Too little free space under the offload root for the planned run."""


def check_space(root: str | os.PathLike, needed_bytes: int) -> int:
    """Fail before a run if `root` is unwritable or has less than `needed_bytes` free; returns the free bytes."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        # A real probe file: permission bits say nothing for root, or for a read-only mount.
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise OffloadDirError(f"offload dir {root} is not writable: {e}") from e
    free = shutil.disk_usage(root).free
    if free < needed_bytes:
        raise DiskSpaceError(
            f"offload dir {root} needs {needed_bytes} bytes but only {free} bytes are free "
            f"({needed_bytes / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free)")
    return free


LOCK_NAME = ".lock"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:                        # kill(0) would signal our own process group: never "dead"
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:             # another user's live process
        return True
    return True


def _tree_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _try_lock(lock_path: Path) -> int | None:
    """An fd holding `lock_path`'s exclusive flock, or None when a live process holds it (or it is unreadable)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_stale(root: str | os.PathLike, prefix: str = "flexgen_h2o", *, announce: bool = True) -> tuple[int, int]:
    """Remove run folders under `root` left by dead processes; returns (folders removed, bytes freed).

    Only `<prefix>-<pid>-<8 hex>` folders are considered. One with a lock file is stale iff its flock can be
    taken (held while it is removed, so two sweeping runs never race); one without is stale iff its pid is gone.
    With `announce`, one line on stderr says what was removed."""
    root = Path(root)
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]{{8}}")
    try:
        entries = list(os.scandir(root))
    except OSError:                     # no root yet (nothing to sweep) or unreadable: the run reports it later
        return 0, 0
    count = freed = 0
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        lock_path = path / LOCK_NAME
        fd = None
        if os.path.lexists(lock_path):
            fd = _try_lock(lock_path)
            if fd is None:
                continue                # a live run (or a lock we cannot open): never touch it
        elif _pid_alive(int(m.group(1))):
            continue                    # being created right now, or an older version's live run
        try:
            size = _tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                count, freed = count + 1, freed + size
        finally:
            if fd is not None:
                os.close(fd)
    if count and announce:
        print(f"offload dir: removed {count} folder(s) left by dead runs ({_human(freed)}) under {root}",
              file=sys.stderr, flush=True)
    return count, freed


def _human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    exp = min(3, (n.bit_length() - 1) // 10)
    return f"{n / 1024 ** exp:.1f} {('KiB', 'MiB', 'GiB')[exp - 1]}"


class OffloadDir:
    """Context manager yielding a fresh, private run folder under `root`."""

    def __init__(self, root: str | os.PathLike, *, needed_bytes: int = 0, prefix: str = "flexgen_h2o",
                 handle_signals: bool = True) -> None:
        self.root = Path(root)
        self.needed_bytes = needed_bytes
        self.prefix = prefix
        self.handle_signals = handle_signals
        self.path: Path | None = None
        self._lock_fd: int | None = None
        self._old_handlers: dict[int, Any] = {}

    def __enter__(self) -> Path:
        sweep_stale(self.root, self.prefix)     # first: the space check then counts what the sweep freed
        check_space(self.root, self.needed_bytes)
        while True:      # pid keeps runs apart, the random part keeps reruns in one process apart
            path = self.root / f"{self.prefix}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        self.path = path
        try:
            self._lock_fd = self._hold_lock(path)
        except OSError as e:
            shutil.rmtree(path, ignore_errors=True)
            raise OffloadDirError(f"offload dir {path}: cannot lock {LOCK_NAME}: {e.strerror or e}") from e
        atexit.register(self.cleanup)
        # Signal handlers can only be installed from the main thread; elsewhere atexit/__exit__ still clean up.
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old = signal.getsignal(sig)
                if old is signal.SIG_IGN:        # the user asked to ignore it; so do we
                    continue
                self._old_handlers[sig] = old
                signal.signal(sig, self._on_signal)
        return path

    def __exit__(self, *exc: Any) -> None:
        self._restore_handlers()
        atexit.unregister(self.cleanup)
        self.cleanup()

    @staticmethod
    def _hold_lock(path: Path) -> int | None:
        """Lock a temporary file, then rename it to `.lock`: a sweeper never sees an unlocked `.lock` of ours."""
        tmp = path / (LOCK_NAME + ".new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.remove(tmp)          # a filesystem without flock: sweepers fall back to our (live) pid
                return None
            raise
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(tmp, path / LOCK_NAME)
        return fd

    def cleanup(self) -> None:
        """Remove the run folder (idempotent; safe from a signal handler or atexit)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:   # released after the removal, so no sweeper races our own rmtree
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)

    def _restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        self.cleanup()
        self._restore_handlers()
        if callable(old):                   # chain: default_int_handler raises KeyboardInterrupt
            old(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            sys.exit(128 + signum)
