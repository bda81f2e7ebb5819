"""Offload-directory hygiene: a unique per-run folder that is removed on every way out, and a space check.

FlexGen wrote into a shared `--offload-dir` and left files behind on Ctrl-C; two runs sharing it could clobber each
other. `OffloadDir` makes `<root>/flexgen_h2o-<pid>-<random>` and removes it on normal exit, on exceptions, on
SIGINT/SIGTERM and at interpreter exit. Stdlib only.
"""
from __future__ import annotations

import atexit
import os
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


class OffloadDir:
    """Context manager yielding a fresh, private run folder under `root`."""

    def __init__(self, root: str | os.PathLike, *, needed_bytes: int = 0, prefix: str = "flexgen_h2o",
                 handle_signals: bool = True) -> None:
        self.root = Path(root)
        self.needed_bytes = needed_bytes
        self.prefix = prefix
        self.handle_signals = handle_signals
        self.path: Path | None = None
        self._old_handlers: dict[int, Any] = {}

    def __enter__(self) -> Path:
        check_space(self.root, self.needed_bytes)
        while True:      # pid keeps runs apart, the random part keeps reruns in one process apart
            path = self.root / f"{self.prefix}-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        self.path = path
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

    def cleanup(self) -> None:
        """Remove the run folder (idempotent; safe from a signal handler or atexit)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

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
