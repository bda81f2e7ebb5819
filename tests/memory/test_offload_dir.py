"""Offload-dir hygiene: unique per-run folders, removed on every way out; space checked before a run."""
from __future__ import annotations

import os
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


# --- folders left by runs that could not clean up (SIGKILL, the OOM killer) ---

def _child(root: Path) -> tuple[subprocess.Popen, Path]:
    """A real process holding an OffloadDir under `root` (with a 4096-byte file in it), and its folder."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(root), offload_dir.__file__],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        pytest.fail("child died before creating its folder")
    return proc, Path(line)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_folder_of_a_sigkilled_run_is_removed_by_the_next_run(tmp_path, capfd):
    proc, left = _child(tmp_path)
    proc.kill()                                   # SIGKILL: no handler, no atexit
    proc.wait(timeout=30)
    assert left.is_dir() and (left / "kv.npy").stat().st_size == 4096 and (left / ".lock").is_file()
    capfd.readouterr()
    with OffloadDir(tmp_path) as mine:
        err = capfd.readouterr().err
        assert not left.exists() and mine.is_dir()
        assert [p.name for p in tmp_path.iterdir()] == [mine.name]
    size = 4096 + len(f"{proc.pid}\n")            # the file and the lock file, which holds the pid
    assert err.splitlines() == [f"offload dir: removed 1 folder(s) left by dead runs ({size / 1024:.1f} KiB) "
                                f"under {tmp_path}"]
    # a second run finds nothing to remove and says nothing
    with OffloadDir(tmp_path):
        pass
    assert capfd.readouterr().err == ""


def test_live_runs_and_unrelated_folders_are_left_alone(tmp_path, capfd):
    proc, live = _child(tmp_path)
    try:
        dead = _dead_pid()
        unrelated = ["flexgen_h2o-x-1234abcd", "other-1-1234abcd", f"flexgen_h2o-{dead}-1234abcd.bak",
                     f"flexgen_h2o-{dead}-1234abc", f"Flexgen_h2o-{dead}-1234abcd", "flexgen_h2o-keep"]
        for name in unrelated:
            (tmp_path / name).mkdir()
            (tmp_path / name / "data").write_bytes(b"1" * 10)
        (tmp_path / f"flexgen_h2o-{dead}-0000aaaa.txt").write_text("a file, not a folder")
        # no lock file (an older version, or killed while creating it): its pid decides
        (tmp_path / f"flexgen_h2o-{os.getpid()}-0000bbbb").mkdir()            # pid alive: kept
        (tmp_path / f"flexgen_h2o-{dead}-0000cccc").mkdir()                   # pid gone: removed
        (tmp_path / f"flexgen_h2o-{dead}-0000cccc" / "x").write_bytes(b"2" * 100)
        # a lock file nobody holds, under a live pid (a reused pid): the lock decides, so removed
        reused = tmp_path / f"flexgen_h2o-{os.getpid()}-0000dddd"
        reused.mkdir()
        (reused / ".lock").write_text("1\n")
        before = sorted(p.name for p in tmp_path.iterdir())
        capfd.readouterr()
        assert offload_dir.sweep_stale(tmp_path) == (2, 102)
        err = capfd.readouterr().err
        assert err == f"offload dir: removed 2 folder(s) left by dead runs (102 B) under {tmp_path}\n"
        after = sorted(p.name for p in tmp_path.iterdir())
        assert after == sorted(set(before) - {f"flexgen_h2o-{dead}-0000cccc", reused.name})
        assert (live / "kv.npy").stat().st_size == 4096 and proc.poll() is None      # the live run untouched
        assert all((tmp_path / n / "data").read_bytes() == b"1" * 10 for n in unrelated)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # once its process is gone, the formerly live folder is stale too
    assert offload_dir.sweep_stale(tmp_path, announce=False) == (1, 4096 + len(f"{proc.pid}\n"))
    assert not live.exists()
