"""The compiled CPU kernels for H2O's attention (csrc/), built at install or on first use.

- Prompt (csrc/scored_attention.cpp): the attention output and every key's attention mass in one pass whose 3 MB
  blocks of logits stay in the core's caches, with a softmax over each query's own keys that adds the row into
  the mass as it scales it; the same math as torch ops (ops.grouped_attention) makes 16 MB blocks that every
  pass reads from L3 or DRAM.
- Decode (csrc/decode_attention.cpp): one step over the fp16 cache read in place, each key or value vector
  converted in a register and used there by up to three query heads of its group, the window's lines requested
  ahead of use; the torch ops (ops.narrow_decode_attention) upcast the window with copy_ and multiply it with
  small batched GEMMs.
- Commit (csrc/commit_step.cpp, called by kv.cache.KVCache): a decode step's K/V row, position and attention
  mass written into a CPU-homed cache and H2O's victim chosen, one pass per (sequence, KV head) column, where
  kv/h2o.py's rules as torch ops make ~40 passes over the whole window.
- Linear (csrc/half_linear.cpp, called by ops.linear for a decode step's few rows): x @ w.T with the fp16 weight
  converted a few rows at a time in L1, where the torch path upcasts chunks of it into a scratch buffer and hands
  them to the BLAS.
- Layer math (csrc/layer_math.cpp, called by ops): RMSNorm, SwiGLU's gate and RoPE in one pass each, a decode
  step's on the calling thread, where each torch op is a parallel region that wakes the sleeping OpenMP threads
  (OMP_WAIT_POLICY=PASSIVE); a prompt's across the threads, one pass where RoPE's torch ops make five.

Where they come from (isa_flags() to module() below): `pip install --no-build-isolation -e .` after torch (make
install) compiles them with the package into flexgen_h2o/models/_kernels (setup.py), stamped with source_hash() of
csrc/, the compile flags and torch's version; module() uses that build while the stamp matches the files on
disk. A missing or stale one (a .cpp edited since, another CPU's flags, FLEXGEN_H2O_KERNEL_ISA=portable) is
compiled by torch's C++ extension loader (a C++ compiler and ninja) into TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions), in a folder named after this source tree, so only the first process after a change
pays (65 s from scratch on this project's 2-core VM; README.md has the command), and two checkouts never evict
each other's builds. That build holds a flock in its folder, so a `lock` file left by a killed build is removed
instead of waited on forever. `build_ahead()` readies them before any timed run (`make install` calls it).
Where they cannot be built, the torch-op path is used and the reason is printed once.
FLEXGEN_H2O_FUSED_ATTENTION=0 turns all of them off (A/B runs). On a CPU with AVX2, FMA and F16C they are built
with those instructions (the decode kernels' fp16 conversions and dot products use them; csrc/simd.h holds the
switch); elsewhere as plain C++.

setup.py loads this file by path to build them: keep its imports to the standard library and torch.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("bindings.cpp", "scored_attention.cpp", "decode_attention.cpp", "commit_step.cpp",
                                        "half_linear.cpp", "layer_math.cpp")]
ENV_SWITCH = "FLEXGEN_H2O_FUSED_ATTENTION"
LAYER_MATH_SWITCH = "FLEXGEN_H2O_FUSED_LAYER_MATH"   # "0": only the layer math on torch ops (A/B runs)
# queries per block: 3 heads x 128 queries x 2,048 keys of fp32 logits is 3 MB, about one core's L2 plus its
# share of L3 (a sweep of 64-256 at SmolLM2's 2,048-token prompts moved the kernel's time by a few % at most)
Q_BLOCK = 128

_lock = threading.Lock()
# "module" once built, "reason" once it could not be; "origin": where build() found the package's kernels
_state: dict[str, object] = {}


ISA_SWITCH = "FLEXGEN_H2O_KERNEL_ISA"      # "portable": build without the AVX2 flags (the test of that path)
PREBUILT = "flexgen_h2o.models._kernels"   # setup.py's extension
STAMP_SYMBOL = "flexgen_h2o_kernels_source_hash"
BUILD_FLOCK = "flexgen_h2o.flock"          # beside torch's `lock` in the JIT build folder
WAIT_ENV = "FLEXGEN_H2O_KERNEL_BUILD_WAIT"  # seconds to wait for another process's build (default 900)
LDFLAGS = ["-fopenmp"]


def isa_flags() -> list[str]:
    """-mavx2 -mfma -mf16c where this CPU has them (torch's own dispatch says AVX2 or better), else none."""
    if os.environ.get(ISA_SWITCH) != "portable" and torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        return ["-mavx2", "-mfma", "-mf16c"]      # "AVX2", "AVX512": x86 only
    return []


def cflags(flags: list[str] | None = None) -> list[str]:
    """The compile flags, the same for setup.py's build and the JIT one. -fopenmp: the prompt kernel sets its
    threads' OpenMP team size (the libgomp torch has loaded is the one used)."""
    return ["-O3", "-fopenmp", *(isa_flags() if flags is None else flags)]


def source_hash(csrc: Path = CSRC, flags: list[str] | None = None) -> str:
    """16 hex digits over every file in csrc (name and bytes; editors' dot-files aside), the compile flags and
    torch's version: what a build was made from. An edited header counts: every kernel includes one."""
    digest = hashlib.sha256()
    for path in sorted(p for p in csrc.iterdir() if p.is_file() and not p.name.startswith(".")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(cflags(flags)).encode() + b"\0" + torch.__version__.encode())
    return digest.hexdigest()[:16]


def stamp_source(stamp: str) -> str:
    """The C++ file setup.py compiles into the extension: the stamp as an exported symbol, read back by
    built_stamp() without touching bindings.cpp."""
    return (f"// generated by setup.py: the sources this build was made from (models/fused.py, source_hash)\n"
            f'extern "C" __attribute__((visibility("default"), used)) const char {STAMP_SYMBOL}[] = "{stamp}";\n')


def built_stamp(path: str | Path) -> str | None:
    """The stamp compiled into the shared library at `path`, None where it has none (OSError: it does not load)."""
    lib = ctypes.CDLL(str(path))       # the same handle as Python's import of it, once torch is loaded
    try:
        return ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(lib, STAMP_SYMBOL))).decode()
    except ValueError:                 # no such symbol: not one of setup.py's builds
        return None


def prebuilt(csrc: Path = CSRC, name: str = PREBUILT) -> tuple[ModuleType | None, str]:
    """The kernels built with the package (module `name`) when their stamp matches csrc and this process's flags,
    else None; and a few words on which it was."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None, "the install built none"
    try:
        stamp = built_stamp(spec.origin)
    except OSError as exc:             # built against another torch, say
        return None, f"the install's build does not load: {str(exc).strip()[:200]}"
    want = source_hash(csrc)
    if stamp != want:
        return None, f"the install's build is of other sources or flags (stamp {stamp}, csrc/ now {want})"
    return importlib.import_module(name), "built at install"


def jit_name(sources: list[Path], tag: str = "", flags: list[str] | None = None) -> str:
    """The JIT build's name (and folder): it carries the instruction set, so a cache shared by two kinds of CPU
    keeps both, and a hash of the source folder and torch's version, so two checkouts (or venvs) sharing one
    cache keep a build each: one folder for both rebuilt everything on each switch (ninja sees other paths)."""
    flags = isa_flags() if flags is None else flags
    tree = hashlib.sha256(f"{sources[0].parent.resolve()}\0{torch.__version__}".encode()).hexdigest()[:8]
    return f"flexgen_h2o_kernels{tag}{'_avx2' if flags else ''}_{tree}"


class BuildLockTimeout(TimeoutError):
    """Another live process held the build folder's flock past the wait."""


@contextmanager
def build_lock(build_dir: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold BUILD_FLOCK in build_dir (waiting up to wait_s, default WAIT_ENV or 900 s, for another process) around
    torch's load(). torch's own `lock` file (O_EXCL, no pid) outlives a killed build, and every later load waited
    on it forever; the kernel drops a dead process's flock, so a `lock` found while holding ours is stale."""
    wait_s = float(os.environ.get(WAIT_ENV, "900")) if wait_s is None else wait_s
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / BUILD_FLOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = path.read_text().strip() or "?"
                if time.monotonic() - start >= wait_s:
                    raise BuildLockTimeout(f"gave up after {wait_s:.0f} s waiting for pid {holder} to finish "
                                           f"building the kernels; if it is stuck, end it or remove {path}") from None
                if not told:
                    print(f"flexgen_h2o: waiting up to {wait_s:.0f} s for pid {holder}, which is building the "
                          f"compiled kernels in {build_dir}", file=sys.stderr)
                    told = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)      # named in the others' messages
        stale = build_dir / "lock"
        if stale.exists():
            _wait_for_orphans(build_dir, start + wait_s)
            stale.unlink()
            print(f"flexgen_h2o: removed {stale}, left by a kernel build that was killed", file=sys.stderr)
        yield
    finally:
        os.close(fd)                                      # releases the flock


def _wait_for_orphans(build_dir: Path, deadline: float) -> None:
    """Wait for the processes still working in build_dir (Linux's /proc: their cwd) to end: a killed build's ninja
    and compilers go on as orphans, and a second ninja beside them writes the same files."""
    folder, told = str(build_dir.resolve()), False
    while True:
        pids = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if os.readlink(entry / "cwd") == folder and int(entry.name) != os.getpid():
                    pids.append(entry.name)
            except OSError:                  # gone, or not ours to read
                pass
        if not pids:
            return
        named = ", ".join(pids[:4]) + (f" and {len(pids) - 4} more" if len(pids) > 4 else "")
        if time.monotonic() >= deadline:
            raise BuildLockTimeout(f"gave up waiting for pid {named}, left running in {build_dir} by a killed "
                                   f"kernel build; end them, then remove {build_dir / 'lock'}")
        if not told:
            print(f"flexgen_h2o: waiting for pid {named}, left running in {build_dir} by a killed kernel build",
                  file=sys.stderr)
            told = True
        time.sleep(0.2)


def jit_build(sources: list[Path] = SOURCES, tag: str = "", wait_s: float | None = None) -> ModuleType:
    """Compile (or load from the cache) the kernels from these sources, the include folder beside them, under
    build_lock. A tag names another build (benchmarks.studies.ab.kernels_at: an older revision's kernels)."""
    from torch.utils.cpp_extension import _get_build_directory, load     # late: it pulls in setuptools
    flags = isa_flags()
    name = jit_name(sources, tag, flags)
    build_dir = Path(_get_build_directory(name, verbose=False))          # torch's own choice of folder
    with build_lock(build_dir, wait_s):
        built = build_dir / f"{name}.so"
        newest = max(p.stat().st_mtime for p in sources[0].parent.iterdir())
        if not built.exists() or built.stat().st_mtime < newest:       # a silent minute looks like a hang
            print(f"flexgen_h2o: compiling the kernels in {build_dir} (once per change to csrc/; about a minute)",
                  file=sys.stderr)
        return load(name=name, sources=[str(p) for p in sources], extra_cflags=cflags(flags),
                    extra_include_paths=[str(sources[0].parent)], extra_ldflags=LDFLAGS,
                    build_directory=str(build_dir), verbose=False)


def build(sources: list[Path] = SOURCES, tag: str = "") -> ModuleType:
    """The kernels from these sources: for the package's own, the build made at install where it matches
    (prebuilt()), else jit_build(); where they came from goes in _state["origin"] for build_ahead()."""
    if sources == SOURCES and not tag:
        ext, why = prebuilt()
        if ext is not None:
            _state["origin"] = why
            return ext
        ext = jit_build(sources, tag)
        _state["origin"] = f"compiled on first use: {why}"
        return ext
    return jit_build(sources, tag)


def module() -> ModuleType | None:
    """The built kernel, or None where it is switched off or cannot be built (reason printed once)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if "module" in _state:                     # every attention layer asks: no lock once it is built
        return _state["module"]                                          # type: ignore[return-value]
    with _lock:
        if "module" in _state or "reason" in _state:
            return _state.get("module")                                  # type: ignore[return-value]
        try:
            _state["module"] = build()
        except Exception as exc:                   # no compiler, no ninja, no Python headers: run without it
            reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            _state["reason"] = reason
            hint = "" if isinstance(exc, BuildLockTimeout) else "needs a C++ compiler and ninja; "
            print(f"flexgen_h2o: compiled attention kernels unavailable ({reason}); using torch ops "
                  f"({hint}{ENV_SWITCH}=0 hides this)", file=sys.stderr)
        return _state.get("module")                                      # type: ignore[return-value]


def use(ext: object) -> ModuleType | None:
    """Make module() return `ext` (another build of the kernels, or the built one wrapped: the A/B and profiling
    benchmarks) and return the module it replaces, to be put back with use() again."""
    replaced = module()
    _state["module"] = ext
    return replaced


def unavailable_reason() -> str | None:
    """Why module() gave None, after it was called (None when it is built or switched off)."""
    return _state.get("reason")                                          # type: ignore[return-value]


def usable(q: Tensor) -> bool:
    """Whether this prompt's attention can go to the kernel: fp32 on a CPU, kernel built."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and module() is not None


def decode_usable(q: Tensor, k: Tensor) -> bool:
    """Whether a decode step over the window k can go to the kernel: fp32 queries over an fp16 cache on a CPU,
    each (sequence, KV head) block of rows contiguous, kernel built."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k.dtype == torch.float16 and k.dim() == 4
            and k.stride(3) == 1 and k.stride(2) == k.shape[3] and module() is not None)


def scored_prompt_attention(q: Tensor, k: Tensor, v: Tensor, token_valid: Tensor | None, scale: float,
                            score_reduce: str = "sum") -> tuple[Tensor, Tensor]:
    """out (b, h, t, d) and the mass (b, g, t) each key received from the valid queries, pooled over its
    group's query heads (sum, or mean over the group), for a prompt attending to itself under
    ops.causal_pad_mask(token_valid) (None: no pads). The same values as ops.grouped_attention's scored path,
    to fp32 rounding (the sums run in another order)."""
    ext = module()
    assert ext is not None, "call usable() first"
    valid = torch.empty(0, dtype=torch.bool) if token_valid is None else token_valid
    out, mass = ext.scored_prompt_attention(q, k.contiguous(), v.contiguous(), valid, float(scale), Q_BLOCK)
    if score_reduce == "mean":
        mass /= q.shape[1] // k.shape[1]
    return out, mass


def decode_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, slot: Tensor, k_new: Tensor, v_new: Tensor,
                     scale: float, *, want_scores: bool = False,
                     score_reduce: str = "sum") -> tuple[Tensor, Tensor | None]:
    """ops.narrow_decode_attention's contract and values (to fp32 rounding: the sums run in another order), for
    an fp16 window read in place: out (b, h, 1, d) and, if want_scores, the mass (b, g, s) each key received."""
    ext = module()
    assert ext is not None, "call decode_usable() first"
    out, mass = ext.decode_attention(q, k, v, valid, slot, k_new, v_new, float(scale), want_scores,
                                     score_reduce == "mean")
    return out, (mass if want_scores else None)


def half_linear_usable(x: Tensor, w: Tensor) -> bool:
    """Whether x @ w.T can go to the fp16-weight kernel: fp32 x on a CPU, an fp16 (n, k) weight of contiguous
    rows, kernel built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float16 and w.dim() == 2
            and w.is_contiguous() and module() is not None)


def half_linear(x: Tensor, w: Tensor) -> Tensor:
    """x (m, k) fp32 @ w.T for an fp16 weight (n, k): (m, n) fp32, the product of the upcast weight to fp32
    rounding (the sums run in another order than the BLAS's)."""
    ext = module()
    assert ext is not None, "call half_linear_usable() first"
    return ext.half_linear(x.contiguous(), w)


def layer_math_usable(x: Tensor) -> bool:
    """Whether x's element-wise layer math (RMSNorm, SwiGLU's gate, RoPE) goes to layer_math.cpp: fp32 on a CPU,
    kernel built, not switched off on its own. A decode step's tensors run there on the calling thread, a
    prompt's across torch's threads (the kernel decides by size)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and os.environ.get(LAYER_MATH_SWITCH, "1") != "0"
            and module() is not None)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """ops.rms_norm's values (to fp32 rounding: the mean square is summed in another order)."""
    return module().rms_norm_rows(x.contiguous(), weight.contiguous(), float(eps))


def silu_mul_(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, written into gate (a fresh projection), to fp32 rounding of the torch ops."""
    return module().silu_mul_(gate, up.contiguous())


def rope_usable(x: Tensor) -> bool:
    """layer_math_usable, and for a prompt (t > 1) a build whose rope_rows takes prompts: one built from an older
    revision (benchmarks' --base) takes one token only, so its prompts keep the torch ops."""
    return layer_math_usable(x) and (x.shape[2] == 1 or getattr(module(), "rope_rows_takes_prompts", False))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """ops.apply_rope's values bit for bit on x86 (csrc/layer_math.cpp says why): x (b, h, t, d) by cos, sin
    (b, 1, t, d), as a new contiguous tensor.
    A decode step's token runs on the calling thread, a prompt's rows across torch's threads."""
    return module().rope_rows(x, cos.contiguous(), sin.contiguous())


def build_ahead() -> int:
    """Load (the install's build) or build (or find cached) the kernels before any timed run, and say which;
    `make install` calls it. 0 when ready."""
    if module() is None:
        print(f"flexgen_h2o: compiled attention kernels not built: {unavailable_reason() or 'switched off'}",
              file=sys.stderr)
        return 1
    print(f"flexgen_h2o: compiled attention kernels ready ({', '.join(p.name for p in SOURCES[1:])}"
          f"{'; AVX2' if isa_flags() else ''}; {_state.get('origin', 'set by use()')})")
    return 0
