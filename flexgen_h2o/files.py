"""Small file writes that a kill or a full disk must never leave half done (level 0: stdlib only)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """`data` into `path` through a temporary file beside it, fsync'd and renamed over it: a reader sees the old
    file or the new one, never half of one. The temporary file is removed on any error, which is raised."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)      # mkstemp's own mode, 0600, would survive the rename
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def real_path(path: str | os.PathLike) -> Path:
    """The file a path names once every symlink is followed: a batch job's lock, rewrite and the files beside its
    output go by it, so an alias of an output is that output (and a symlinked output stays a symlink)."""
    return Path(os.path.realpath(Path(path).expanduser()))
