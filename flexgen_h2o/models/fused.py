"""The compiled CPU kernels for H2O's attention (csrc/), built on first use.

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

They are built with torch's C++ extension loader (a C++ compiler and ninja) and cached in
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), so only the first process after a change pays the
build (65 s for the four kernels on this project's 2-core VM; README.md has the command). `build_ahead()` builds
it before any timed run (`make install` calls it). Where it cannot be built, the torch-op path is used and the
reason is printed once. FLEXGEN_H2O_FUSED_ATTENTION=0 turns all of them off (A/B runs). On a CPU with AVX2, FMA
and F16C they are built with those instructions (the decode kernels' fp16 conversions and dot products use
them; csrc/simd.h holds the switch); elsewhere as plain C++.
"""
from __future__ import annotations

import os
import sys
import threading
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
_state: dict[str, object] = {}          # "module" once built; "reason" once it could not be


ISA_SWITCH = "FLEXGEN_H2O_KERNEL_ISA"      # "portable": build without the AVX2 flags (the test of that path)


def isa_flags() -> list[str]:
    """-mavx2 -mfma -mf16c where this CPU has them (torch's own dispatch says AVX2 or better), else none."""
    if os.environ.get(ISA_SWITCH) != "portable" and torch.backends.cpu.get_cpu_capability().startswith("AVX"):
        return ["-mavx2", "-mfma", "-mf16c"]      # "AVX2", "AVX512": x86 only
    return []


def build(sources: list[Path] = SOURCES, tag: str = "") -> ModuleType:
    """Compile (or load from the cache) the kernels from these sources, the include folder beside them. A tag
    names another build (benchmarks.common.kernels_at: an older revision's kernels beside these)."""
    from torch.utils.cpp_extension import load     # imported late: it pulls in setuptools
    flags = isa_flags()
    # -fopenmp: the prompt kernel sets its threads' OpenMP team size (the libgomp torch has loaded is the one
    # used). The name carries the instruction set, so a cache directory shared by two kinds of CPU keeps both
    return load(name="flexgen_h2o_kernels" + tag + ("_avx2" if flags else ""), sources=[str(p) for p in sources],
                extra_cflags=["-O3", "-fopenmp", *flags], extra_include_paths=[str(sources[0].parent)],
                extra_ldflags=["-fopenmp"], verbose=False)


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
            print(f"flexgen_h2o: compiled attention kernels unavailable ({reason}); using torch ops "
                  f"(needs a C++ compiler and ninja; {ENV_SWITCH}=0 hides this)", file=sys.stderr)
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
    """Build (or find cached) the kernel before any timed run; `make install` calls it. 0 when ready."""
    if module() is None:
        print(f"flexgen_h2o: compiled attention kernels not built: {unavailable_reason() or 'switched off'}",
              file=sys.stderr)
        return 1
    print(f"flexgen_h2o: compiled attention kernels ready ({', '.join(p.name for p in SOURCES[1:])}"
          f"{'; AVX2' if isa_flags() else ''})")
    return 0
