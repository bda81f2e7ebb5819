"""Where the compiled kernels come from (kernels/build.py, setup.py): the install's build used only while its stamp
matches csrc/, a JIT build that clears a killed build's `lock` instead of waiting on it forever, waits for a
live one with a time limit, and keeps one folder per source tree. The JIT tests compile a tiny C extension (a
few seconds), not the kernels."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flexgen_h2o.kernels import build

REPO = Path(__file__).resolve().parents[1]
STAMP = "0123456789abcdef"

# a Python module with no torch headers (they take a minute to compile), named as torch's load() names it
TINY = """#include <Python.h>
#define TINY_CAT2(a, b) a##b
#define TINY_CAT(a, b) TINY_CAT2(a, b)
#define TINY_STR2(a) #a
#define TINY_STR(a) TINY_STR2(a)
static PyModuleDef tiny = {PyModuleDef_HEAD_INIT, TINY_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC TINY_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tiny); }
"""

# the killed build: torch's `lock` left in the build folder with no process behind it
BUILD_WITH_A_STALE_LOCK = """
import json, sys, time
from pathlib import Path
from torch.utils.cpp_extension import _get_build_directory
from flexgen_h2o.kernels import build
sources = [Path(p) for p in sys.argv[1:]]
folder = Path(_get_build_directory(build.jit_name(sources, "_test"), verbose=False))
(folder / "lock").touch()
start = time.monotonic()
ext = build.jit_build(sources, "_test", wait_s=5)
print(json.dumps({"file": ext.__file__, "folder": str(folder), "seconds": time.monotonic() - start,
                  "stamp": build.built_stamp(ext.__file__)}))
"""

# another process in the middle of a build: it holds the flock and torch's `lock`, and its ninja (a child
# working in the folder for argv[2] seconds, orphaned if it is killed) compiles
HOLDER = """
import fcntl, os, subprocess, sys, time
folder = sys.argv[1]
fd = os.open(os.path.join(folder, "flexgen_h2o.flock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
open(os.path.join(folder, "lock"), "w").close()
ninja = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(%s)" % sys.argv[2]], cwd=folder)
print(ninja.pid, flush=True)
time.sleep(120)
"""


def _csrc_copy(to: Path) -> Path:
    shutil.copytree(build.CSRC, to)
    return to


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory):
    """The tiny extension, stamped with source_hash() of a copy of csrc/, JIT-built by a fresh process over a
    `lock` a killed build left: what it printed, its stderr and the copy."""
    root = tmp_path_factory.mktemp("kernel_build")
    csrc = _csrc_copy(root / "csrc")
    src = root / "tiny"
    src.mkdir()
    (src / "tiny.cpp").write_text(TINY)
    (src / "stamp.cpp").write_text(build.stamp_source(build.source_hash(csrc)))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root / "ext")}
    sources = [str(src / "tiny.cpp"), str(src / "stamp.cpp")]
    done = subprocess.run([sys.executable, "-c", BUILD_WITH_A_STALE_LOCK, *sources], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr, csrc


def _holder(folder: Path, ninja_s: float) -> tuple[subprocess.Popen, int]:
    """The holder, once it holds the lock, and its ninja's pid."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(ninja_s)], stdout=subprocess.PIPE,
                            text=True)
    return proc, int(proc.stdout.readline())


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on(tiny_build):
    built, err, _ = tiny_build
    lock = Path(built["folder"]) / "lock"
    assert f"removed {lock}" in err and not lock.exists()
    assert built["stamp"] == build.source_hash(tiny_build[2])        # the stamp reads back from the .so
    assert built["seconds"] < 240                                   # a compile, not a wait on the lock


def test_a_live_holder_makes_the_loader_wait_then_stop_with_one_line(tmp_path, capsys):
    holder, _ = _holder(tmp_path, 0)
    try:
        start = time.monotonic()
        with pytest.raises(build.BuildLockTimeout) as stopped:
            with build.build_lock(tmp_path, wait_s=1.0):
                pytest.fail("took the lock a live process holds")
        assert 1.0 <= time.monotonic() - start < 10
    finally:
        holder.kill()
        holder.wait()
    message = str(stopped.value)
    assert "\n" not in message and str(tmp_path / build.BUILD_FLOCK) in message and f"pid {holder.pid}" in message
    assert f"waiting up to 1 s for pid {holder.pid}" in capsys.readouterr().err
    assert (tmp_path / "lock").exists()                 # a live build's lock is left alone


def test_a_waiting_loader_goes_on_once_the_holder_is_killed_and_its_ninja_done(tmp_path, capsys):
    holder, ninja = _holder(tmp_path, 4)
    threading.Timer(1.0, holder.kill).start()    # killed mid-build: its flock goes, its `lock` and ninja stay
    start = time.monotonic()
    with build.build_lock(tmp_path, wait_s=60):
        waited = time.monotonic() - start
        assert not (tmp_path / "lock").exists()
        assert (tmp_path / build.BUILD_FLOCK).read_text() == str(os.getpid())
    holder.wait()
    assert 3 < waited < 30                       # the orphaned ninja's 4 s, not only the holder's 1 s
    err = capsys.readouterr().err
    assert f"removed {tmp_path / 'lock'}" in err and f"waiting for pid {ninja}, left running in {tmp_path}" in err


def test_two_source_trees_get_two_build_folders(tmp_path):
    a, b = _csrc_copy(tmp_path / "a" / "csrc"), _csrc_copy(tmp_path / "b" / "csrc")
    names = {build.jit_name([tree / "bindings.cpp"], tag, flags)
             for tree in (a, b) for tag in ("", "_abc") for flags in ([], ["-mavx2"])}
    assert len(names) == 8 and all(name.isidentifier() for name in names)      # a Python module name each
    assert build.jit_name([a / "bindings.cpp"]) == build.jit_name([a / "x.cpp"])   # one tree, one folder
    assert build.jit_name(build.SOURCES, "", ["-mavx2"]).startswith("flexgen_h2o_kernels_avx2_")


def test_the_install_build_is_used_while_its_stamp_matches_the_sources(tiny_build, monkeypatch):
    built, _, csrc = tiny_build
    monkeypatch.syspath_prepend(built["folder"])          # the tiny module stands in for setup.py's
    name = Path(built["file"]).name.split(".")[0]
    ext, why = build.prebuilt(csrc, name)
    assert ext is not None and ext.__file__ == built["file"] and why == "built at install"
    kernel = csrc / "commit_step.cpp"
    original = kernel.read_text()
    kernel.write_text(original + "// edited\n")                  # a developer's edit: compiled again, not stale
    assert build.prebuilt(csrc, name)[0] is None and "other sources" in build.prebuilt(csrc, name)[1]
    kernel.write_text(original)
    assert build.prebuilt(csrc, name)[0] is not None
    (csrc / "new.h").write_text("#pragma once\n")               # a new header counts too
    assert build.prebuilt(csrc, name)[0] is None
    (csrc / "new.h").unlink()
    flags = build.isa_flags()
    monkeypatch.setattr(build, "isa_flags", lambda: [] if flags else ["-mavx2", "-mfma", "-mf16c"])
    assert build.prebuilt(csrc, name)[0] is None                 # other flags (FLEXGEN_H2O_KERNEL_ISA=portable)
    assert build.prebuilt(csrc, "flexgen_h2o_no_such_module") == (None, "the install built none")


def test_load_takes_the_install_build_or_compiles(monkeypatch, capsys, tmp_path):
    installed, compiled = object(), object()
    real_jit_build = build.jit_build
    monkeypatch.delenv(build.OFF_SWITCH, raising=False)
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "prebuilt", lambda: (installed, "built at install"))
    monkeypatch.setattr(build, "jit_build", lambda *a, **kw: pytest.fail("compiled a matching install build"))
    assert build.load() is installed and build.build_ahead() == 0
    assert "built at install" in capsys.readouterr().out
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "prebuilt", lambda: (None, "the install's build is of other sources"))
    monkeypatch.setattr(build, "jit_build", lambda *a, **kw: compiled)
    assert build.load() is compiled and build.build_ahead() == 0
    assert "compiled on first use: the install's build is of other sources" in capsys.readouterr().out
    # other sources (a study's older revision) go to jit_build, under their tag, never to the install's build
    import torch.utils.cpp_extension as cpp
    monkeypatch.setattr(build, "prebuilt", lambda *a: pytest.fail("another revision's kernels are never the install's"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    loaded = {}
    monkeypatch.setattr(cpp, "load", lambda **kw: loaded.update(kw) or compiled)
    sources = [build.CSRC / "bindings.cpp"]
    assert real_jit_build(sources, "_abc") is compiled
    assert loaded["name"] == build.jit_name(sources, "_abc") and loaded["sources"] == [str(sources[0])]


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI's clean install must build the kernels with the package")
def test_ci_installs_the_kernels_built():
    ext, why = build.prebuilt()
    assert ext is not None, why


def test_setup_without_torch_installs_without_kernels():
    """An isolated build (pip's default without --no-build-isolation) has no torch: no extension, a line why."""
    script = ("import sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; "
              "import runpy; runpy.run_path('setup.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "flexgen_h2o", done.stderr[-2000:]
    assert "no compiled kernels built: torch is not importable at build time" in done.stderr
