"""flexgen_h2o: offloaded batch generation with a fixed-size H2O KV cache.

The compiled CPU kernels (flexgen_h2o/kernels/csrc) are built here as flexgen_h2o.kernels._kernels when torch and a
C++ compiler are present at build time: `pip install --no-build-isolation -e .` after torch (make install). An
isolated build (no torch), no compiler or a failed compile builds no extension and says why; the install goes
on, and kernels/build.py compiles them on first use instead (or runs the torch ops). FLEXGEN_H2O_BUILD_KERNELS=0
skips this build.
"""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
BUILD_PY = HERE / "flexgen_h2o" / "kernels" / "build.py"
STAMP_CPP = Path("build") / "flexgen_h2o_stamp" / "kernels_stamp.cpp"   # generated; relative, as setuptools wants


def say(message: str) -> None:
    print(f"flexgen_h2o setup: {message}", file=sys.stderr)


def kernels() -> dict:
    """setup()'s ext_modules and cmdclass for the kernels, or none (and why, printed)."""
    if os.environ.get("FLEXGEN_H2O_BUILD_KERNELS", "1") == "0":
        say("FLEXGEN_H2O_BUILD_KERNELS=0: no compiled kernels built (compiled on first use instead)")
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
        # build.py by path, not by import: the package's __init__ pulls in the rest of the package
        spec = importlib.util.spec_from_file_location("_flexgen_h2o_kernel_build_for_setup", BUILD_PY)
        kbuild = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kbuild)
    except Exception as exc:               # an isolated build has no torch: the package still installs
        say(f"no compiled kernels built: torch is not importable at build time ({exc}); `pip install "
            "--no-build-isolation` after torch builds them, else they are compiled on first use")
        return {}

    class BuildKernels(BuildExtension):
        """torch's BuildExtension, except that a failed build skips the extension instead of the install."""

        def build_extensions(self) -> None:
            try:
                super().build_extensions()
            except Exception as exc:       # no compiler, no Python headers, a compile error
                lines = str(exc).strip().splitlines()
                say(f"no compiled kernels built ({lines[-1] if lines else type(exc).__name__}); they are "
                    "compiled on first use instead, or the engine runs the torch ops")
                self.extensions = []       # nothing for the install to copy

    flags = kbuild.isa_flags()
    stamp = kbuild.stamp_source(kbuild.source_hash(kbuild.CSRC, flags))
    stamp_file = HERE / STAMP_CPP
    if not stamp_file.is_file() or stamp_file.read_text() != stamp:
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        stamp_file.write_text(stamp)
    sources = [str(p.relative_to(HERE)) for p in kbuild.SOURCES] + [str(STAMP_CPP)]
    # after build.py's flags, undo what Python's own CFLAGS add (-g: debug info that bloats the .so; -fwrapv,
    # -DNDEBUG), so this build compiles as the JIT one does
    ext = CppExtension("flexgen_h2o.kernels._kernels", sources, include_dirs=[str(kbuild.CSRC)],
                       extra_compile_args=[*kbuild.cflags(flags), "-g0", "-fno-wrapv", "-UNDEBUG"],
                       extra_link_args=kbuild.LDFLAGS)
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildKernels}}


setup(
    name="flexgen_h2o",
    version="0.1.0",
    description="High-throughput offline generation for OPT and Llama with offloading and H2O eviction",
    packages=find_packages(include=["flexgen_h2o", "flexgen_h2o.*"]),
    python_requires=">=3.10",
    # transformers 5.24 warns that generate's and forward's past_key_values goes in 5.40; the hf cache and its
    # tests pass caches that way, so a clean install must not pick up the release that removes it
    install_requires=["torch", "numpy", "transformers>=5.0,<5.40", "safetensors", "psutil", "tqdm",
                      "ninja"],             # builds the compiled kernels on first use (kernels/build.py)
    package_data={"flexgen_h2o.kernels": ["csrc/*.cpp", "csrc/*.h"]},
    extras_require={
        "test": ["pytest", "pytest-timeout"],
        "eval": ["rouge-score", "matplotlib", "wonderwords"],
        "bench": ["accelerate", "matplotlib"],
        "gguf": ["gguf", "accelerate"],
    },
    entry_points={"console_scripts": ["flexgen-h2o=flexgen_h2o.run:main"]},
    **kernels(),
)
