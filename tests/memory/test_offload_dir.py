"""Offload-dir hygiene: unique per-run folders, removed on every way out; space checked before a run."""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flexgen_h2o.memory import offload_dir
from flexgen_h2o.memory import DiskSpaceError, OffloadDir, OffloadDirError, check_space


def test_removed_on_normal_exit_and_on_exception(tmp_path):
    with OffloadDir(tmp_path) as p:
        (p / "a.npy").write_bytes(b"x" * 100)
        assert p.parent == tmp_path and p.is_dir()
    assert not p.exists()
    with pytest.raises(ZeroDivisionError):
        with OffloadDir(tmp_path) as p2:
            (p2 / "b.npy").write_bytes(b"y")
            1 / 0
    assert not p2.exists() and list(tmp_path.iterdir()) == []


def test_two_runs_on_one_root_get_distinct_folders(tmp_path):
    with OffloadDir(tmp_path) as a, OffloadDir(tmp_path) as b:
        assert a != b and a.is_dir() and b.is_dir()
    assert list(tmp_path.iterdir()) == []


# offload_dir.py is stdlib-only: load it by path so the child starts in milliseconds, without importing torch.
SCRIPT = textwrap.dedent("""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("offload_dir", sys.argv[2])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with mod.OffloadDir(sys.argv[1]) as p:
        (p / "kv.npy").write_bytes(b"0" * 4096)
        print(p, flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_removed_on_signal(tmp_path, sig):
    # a shell's background job starts with SIGINT ignored, which the child would inherit (and, rightly, keep
    # ignoring): give it the default disposition, as a foreground run has
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), offload_dir.__file__],
                            stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline().strip()
        assert line, "child died before creating its folder"
        assert Path(line).is_dir() and Path(line).parent == tmp_path
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc != 0
    assert list(tmp_path.iterdir()) == []


def test_check_space_reports_needed_and_free(tmp_path):
    needed = 10 ** 18
    with pytest.raises(DiskSpaceError) as ei:
        check_space(tmp_path, needed)
    msg = str(ei.value)
    assert f"needs {needed} bytes" in msg
    free = int(re.search(r"only (\d+) bytes are free", msg).group(1))
    assert 0 < free <= shutil.disk_usage(tmp_path).free * 2
    assert check_space(tmp_path, 1) > 0


def test_check_space_unwritable_root(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(OffloadDirError, match="not writable"):
        check_space(blocker / "offload", 1)
    with pytest.raises(OffloadDirError):
        with OffloadDir(blocker / "offload"):
            pass
