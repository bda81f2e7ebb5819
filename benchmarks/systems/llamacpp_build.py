"""llama.cpp, built once from the source that PyPI's `llama-cpp-python` sdist vendors, and cached.

The build is native (`GGML_NATIVE=ON`: the build machine's ISA), so it is cached per CPU: the folder is
`<store_root>/llamacpp/<version>-<cpu key>/`, the key a hash of the CPU's model name and flags, and a `.ready`
marker holds the recipe's hash (a changed recipe builds again). Only the two tools the suite drives are built,
`llama-batched-bench` and `llama-quantize`; on two cores that takes about 18 minutes, so the suite's quick mode and
`make test` never build it, they skip llama.cpp with the reason.

    python -m benchmarks.systems.llamacpp_build          # build (or say where the cached build is)
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.systems.venvs import last_line, recipe_hash

VERSION = "0.3.36"            # llama-cpp-python's sdist; it vendors llama.cpp under vendor/llama.cpp
TOOLS = ("llama-batched-bench", "llama-quantize")
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON"]


def cpu_key() -> str:
    """A native build runs only on the CPU it was built for: key the cache by model name and ISA flags."""
    model = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return hashlib.sha256(f"{model}|{flags}".encode()).hexdigest()[:10]


def build_root() -> Path:
    from flexgen_h2o.weights import store_root
    return store_root() / "llamacpp" / f"{VERSION}-{cpu_key()}"


def tool_path(name: str, root: Path | None = None) -> Path:
    return (root or build_root()) / "build" / "bin" / name


RECIPE = recipe_hash([["pip", "download", f"llama-cpp-python=={VERSION}"], ["cmake", *CMAKE_FLAGS],
                      ["cmake", "--build", "--target", *TOOLS]])


def missing_reason(root: Path | None = None) -> str | None:
    """None when the cached build is ready, else why not (and the command that builds it)."""
    root = root or build_root()
    marker = root / ".ready"
    if (marker.is_file() and marker.read_text().split()[:1] == [RECIPE]
            and all(tool_path(t, root).is_file() for t in TOOLS)):
        return None
    return ("llama.cpp is not built for this CPU (about 18 minutes on 2 cores): "
            "python -m benchmarks.systems.llamacpp_build")


def _run(cmd: list[str], log: list[str], cwd: Path | None = None) -> str | None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    log.append(" ".join(cmd) + "\n" + proc.stdout[-20000:] + proc.stderr[-20000:])
    return None if proc.returncode == 0 else last_line(proc.stdout + proc.stderr)


def ensure_build(jobs: int | None = None, root: Path | None = None, say=print) -> str | None:
    """Build llama.cpp's two tools into the cache unless they are there. Returns None when they are usable,
    else a one-line reason. Serialized by a flock, so two suites never build into one folder."""
    root = root or build_root()
    if missing_reason(root) is None:
        return None
    jobs = jobs or os.cpu_count() or 1
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if missing_reason(root) is None:
            return None                                 # another process built it while we waited
        shutil.rmtree(root, ignore_errors=True)         # a killed build's leftovers
        root.mkdir(parents=True)
        log: list[str] = []
        try:
            return _build(root, jobs, log, say)
        finally:
            (root / "build.log").write_text("\n".join(log))


def _build(root: Path, jobs: int, log: list[str], say) -> str | None:
    say(f"llama.cpp {VERSION}: downloading the llama-cpp-python sdist")
    why = _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
                f"llama-cpp-python=={VERSION}", "-d", str(root / "sdist")], log)
    if why:
        return f"llama.cpp download: {why}"
    (sdist,) = (root / "sdist").glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
        tar.extractall(root / "src", members=members, filter="data")
    source = next((root / "src").glob("*/vendor/llama.cpp"))
    say(f"llama.cpp: configuring ({' '.join(CMAKE_FLAGS)})")
    why = _run(["cmake", "-S", str(source), "-B", str(root / "build"), *CMAKE_FLAGS], log)
    if why:
        return f"llama.cpp cmake: {why}"
    say(f"llama.cpp: building {', '.join(TOOLS)} with {jobs} jobs (about 18 minutes on 2 cores)")
    why = _run(["cmake", "--build", str(root / "build"), "--target", *TOOLS, "-j", str(jobs)], log)
    if why:
        return f"llama.cpp build: {why}"
    shutil.rmtree(root / "sdist", ignore_errors=True)
    (root / ".ready").write_text(f"{RECIPE} {source.parent.parent.name}\n")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: every core)")
    args = ap.parse_args(argv)
    why = ensure_build(args.jobs)
    if why:
        print(f"error: {why}; the log is {build_root() / 'build.log'}", file=sys.stderr)
        return 2
    print(f"llama.cpp ready: {tool_path(TOOLS[0]).parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
