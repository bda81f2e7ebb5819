"""Kernels: which compiled kernel takes which call, decided once per engine.

resolve() reads the switches below once and loads the build (kernels/build.py); the engine hands the result to
its layers (StepContext.kernels) and caches (KVCache.kernels), and an HF H2OCache keeps its own (hf/cache.py), so
a switch flipped mid-run changes nothing, and a layer never asks which path runs. The compiled kernels take a
CPU's fp32 math when the build is loaded (Kernels.compiled_on, fixed here); every other call, a GPU's or a CPU's
without the build, runs the plain torch math of models/ops.py (TorchKernels), which is also the reference the
kernels' tests compare against (tests/test_fused_attention.py, tests/test_decode_kernel.py).

Attention has one entry point per phase, TorchKernels.prompt_attention and .decode_attention (models/ops.py),
which models/transformer.py's AttentionLayer calls; hf/attention.py calls prompt_attention, and for a decode step
over H2OCache's window window_attention, the method decode_attention ends in for a staged window. Each phase's
scores (each key's attention mass, which H2O ranks by; at the prompt, from every real query or from the last
StepContext.score_window, ops.score_start) are computed in one place per device:

  phase                                  CPU fp32, build loaded            CUDA, or a CPU without the build
  prompt, scored                         csrc/scored_attention.cpp         ops.grouped_attention
  prompt, output only                    ops.grouped_attention (SDPA)      ops.grouped_attention (SDPA)
  decode, the cache's own fp16/int rows  csrc/decode_attention.cpp         ops.narrow_decode_attention
  decode, a staged window                csrc/decode_attention.cpp (*)     ops.grouped_attention

(*) with batch invariance; FLEXGEN_H2O_BATCH_INVARIANT=0 sends it to ops.grouped_attention (A/B runs).
ops.narrow_decode_attention is ops.grouped_attention over upcast blocks of sequences, so the torch path computes
scores in one function. With batch invariance (below) a CPU prompt attends sequence by sequence on its own tokens
(models/per_sequence.py) through whichever prompt path its rule needs.

- Prompt attention (csrc/scored_attention.cpp): H2O's prompt pass, the output and every key's attention mass in
  one pass whose blocks of logits stay in the core's caches, where ops.grouped_attention's larger blocks are
  read from L3 or DRAM by each of its passes.
- Decode attention (csrc/decode_attention.cpp): one step over the fp16 or quantized cache read in place, each key
  or value row converted in registers and used there by the query heads of its group, where
  ops.narrow_decode_attention upcasts blocks of the window with copy_ and multiplies them with small batched GEMMs.
- Commit (csrc/commit_step.cpp, called by kv.cache.KVCache): a decode step's K/V row, position and mass written
  into a CPU-homed cache and the policy's victim chosen, one pass per (sequence, KV head) column, where kv/'s
  rules as torch ops make ~40 passes over the whole window. A policy names its rule (kv/registry.py).
- Linear (csrc/half_linear.cpp): a decode step's few rows times an fp16 weight, converted a few rows at a time
  in L1; a prompt's many fp32 rows go through oneDNN's GEMM instead of MKL's (onednn_gemm()).
- Layer math (csrc/layer_math.cpp): RMSNorm, SwiGLU's gate and RoPE in one pass each, a decode step's on the
  calling thread, where each torch op is a parallel region that wakes the sleeping OpenMP threads
  (OMP_WAIT_POLICY=PASSIVE); a prompt's across the threads.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from flexgen_h2o.kernels import build
from flexgen_h2o.models import ops
from flexgen_h2o.quant import PackedMatrix

OFF_SWITCH = build.OFF_SWITCH                      # "0": every compiled kernel off (A/B runs)
LAYER_MATH_SWITCH = "FLEXGEN_H2O_FUSED_LAYER_MATH"  # "0": the layer math alone on torch ops (A/B runs)
GEMM_SWITCH = "FLEXGEN_H2O_CPU_GEMM"                # "blas": a prompt's GEMMs on MKL's sgemm instead of oneDNN's
INVARIANT_SWITCH = "FLEXGEN_H2O_BATCH_INVARIANT"    # "0": a prompt's GEMMs on the BLAS, attention batched (A/B runs)
# queries per block: 3 heads x 128 queries x 2,048 keys of fp32 logits is 3 MB, about one core's L2 plus its
# share of L3
Q_BLOCK = 128
HALF_LINEAR_MAX_ROWS = 256       # rows of x up to which the fp16-weight kernel beats upcast chunks + the BLAS
# the same for a packed weight: above it dequantized blocks + the GEMM are faster (docs/compression.md
# "Throughput")
QUANT_LINEAR_MAX_ROWS = 128
ONEDNN_MIN_ROWS = 512            # below this the call's fixed cost outweighs its faster kernel

_onednn: dict[str, object] = {}  # "op": torch.ops.mkldnn._linear_pointwise once it answered right, else None


def onednn_gemm():
    """oneDNN's linear op where it works in this process, else None; checked on the first prompt-sized call, not
    at import, so a process that never runs a prompt pass never loads oneDNN's kernels (the preflight's RSS
    reading at startup stays what it was). MKL's sgemm, torch's default, runs SmolLM2's prompt-sized projections
    and so its prompt pass slower; to compare, `FLEXGEN_H2O_CPU_GEMM=blas|onednn python -m flexgen_h2o.run
    --model smollm2-135m --prompt-len 512 --gen-len 2 --gpu-batch-size 32 [--hh-ratio 0.1]`, prefill_s from
    --metrics-json, interleaved. oneDNN is also what OpenVINO's prompt pass runs on."""
    if "op" not in _onednn:
        _onednn["op"] = None
        try:
            op = torch.ops.mkldnn._linear_pointwise
            x, w = torch.ones(2, 3), torch.ones(4, 3)
            if torch.equal(op(x, w, None, "none", [], ""), x @ w.T):
                _onednn["op"] = op
        except (AttributeError, RuntimeError):     # a torch built without oneDNN, or unusable on this CPU
            pass
    return _onednn["op"]


def gemm_choice(env: Mapping[str, str] | None = None) -> str:
    """"onednn" (the default) or "blas", from GEMM_SWITCH."""
    return "blas" if (os.environ if env is None else env).get(GEMM_SWITCH, "onednn") == "blas" else "onednn"


def onednn_may_run(gemm_rows: int, env: Mapping[str, str] | None = None) -> bool:
    """Whether a CPU prompt pass whose GEMMs have `gemm_rows` rows would take oneDNN (without loading it: the
    planner asks before anything runs)."""
    return (gemm_rows >= ONEDNN_MIN_ROWS and gemm_choice(env) == "onednn"
            and torch.backends.mkldnn.is_available())


class Kernels(ops.TorchKernels):
    """The compiled kernels `ext` (None: none), with the layer math and oneDNN's GEMM each on or off."""

    def __init__(self, ext: ModuleType | None, layer_math: bool = True, gemm: str = "onednn",
                 batch_invariant: bool = True) -> None:
        self.ext = ext
        self.layer_math = layer_math and ext is not None
        self.gemm = gemm
        # Batch invariance (docs/cli.md, "What is guaranteed"): every fp32 linear layer on a CPU goes to the
        # compiled kernels, whose sums run in one order for a row whatever rows come with it (gemm_tile.h), and a
        # prompt attends sequence by sequence on its own tokens (models/per_sequence.py); the BLAS and oneDNN
        # choose their blocking by the GEMM's shape. Needs the compiled linears: torch ops alone cannot promise it.
        self.batch_invariant = batch_invariant and ext is not None and hasattr(ext, "quant_linear")
        self.name = "compiled" if ext is not None else "torch"
        # the device whose fp32 math the compiled kernels take, fixed once: the CPU with the build loaded, else
        # none (every call on the torch ops)
        self.compiled_on = "cpu" if ext is not None else None

    def __repr__(self) -> str:
        return (f"Kernels({self.name}, layer_math={self.layer_math}, gemm={self.gemm}, "
                f"batch_invariant={self.batch_invariant})")

    def _cpu_fp32(self, x: Tensor) -> bool:
        return x.device.type == self.compiled_on and x.dtype == torch.float32

    def _math(self, x: Tensor) -> bool:
        return self.layer_math and x.device.type == "cpu" and x.dtype == torch.float32

    # --- layer math ---

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if self._math(x):                       # one pass (one thread for a decode step)
            return self.ext.rms_norm_rows(x.contiguous(), weight.contiguous(), float(eps))
        return ops.rms_norm(x, weight, eps)

    def apply_rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # angles per (sequence, token), shared by the heads: bit for bit the torch ops on x86 (layer_math.cpp)
        if (self._math(x) and x.dim() == 4 and x.stride(3) == 1
                and cos.shape == sin.shape == (x.shape[0], 1, *x.shape[2:]) and cos.dtype == sin.dtype == x.dtype):
            return self.ext.rope_rows(x, cos.contiguous(), sin.contiguous())
        return ops.apply_rope(x, cos, sin)

    def swiglu_mlp(self, x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
        gate, up = self.linear(x, w_gate), self.linear(x, w_up)
        if gate.is_contiguous() and self._math(gate):
            return self.linear(self.ext.silu_mul_(gate, up.contiguous()), w_down)   # written into gate
        return self.linear(F.silu(gate) * up, w_down)

    # --- linear layers ---

    def _gemm(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """x @ w.T (+ b), x and w of one dtype: oneDNN for a prompt's many fp32 rows on a CPU, else torch."""
        if (self.gemm == "onednn" and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 2
                and x.is_contiguous() and x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1]):
            op = onednn_gemm()
            if op is not None:
                return op(x, w, b, "none", [], "")
        return F.linear(x, w, b)

    def linear(self, x: Tensor, w: Tensor | PackedMatrix, b: Tensor | None = None) -> Tensor:
        """A decode step's few rows times an fp16 weight of contiguous rows or a packed (int4/int8) matrix: the
        compiled kernels. Otherwise ops.linear with this object's GEMM (a packed matrix dequantized by blocks)."""
        if not isinstance(w, PackedMatrix):
            # the decode step's case first, in as few calls as it takes (part of a schedule layer's fixed cost)
            if (w.dtype == torch.float16 and x.dtype == torch.float32 and x.device.type == self.compiled_on
                    and w.dim() == 2 and (self.batch_invariant or x.numel() <= HALF_LINEAR_MAX_ROWS * x.shape[-1])
                    and w.is_contiguous()):
                out = self.ext.half_linear(x.reshape(-1, x.shape[-1]).contiguous(), w).view(*x.shape[:-1],
                                                                                         w.shape[0])
                return out if b is None else out.add_(b.to(x.dtype))
            return ops.linear(x, w, b, gemm=self._gemm)
        few_rows = self.batch_invariant or x.numel() <= QUANT_LINEAR_MAX_ROWS * x.shape[-1]
        if few_rows and self._cpu_fp32(x) and hasattr(self.ext, "quant_linear"):
            out = self.ext.quant_linear(x.reshape(-1, x.shape[-1]).contiguous(), w.rows, w.n_in,
                                        w.quant.bits, w.quant.group_size).view(*x.shape[:-1], w.shape[0])
            return out if b is None else out.add_(b.to(x.dtype))
        return ops.linear(x, w, b, gemm=self._gemm)

    # --- attention ---

    def scored_prompt_attention(self, q: Tensor, k: Tensor, v: Tensor, token_valid: Tensor, unpadded: bool,
                                scale: float, score_reduce: str, query_chunk: int, *,
                                score_window: int | None = None) -> tuple[Tensor, Tensor]:
        """The same values as the torch ops' scored path, to fp32 rounding (the sums run in another order)."""
        if not self._cpu_fp32(q):
            return super().scored_prompt_attention(q, k, v, token_valid, unpadded, scale, score_reduce, query_chunk,
                                                   score_window=score_window)
        valid = torch.empty(0, dtype=torch.bool) if unpadded else token_valid
        out, mass = self.ext.scored_prompt_attention(q, k.contiguous(), v.contiguous(), valid, float(scale), Q_BLOCK,
                                                     ops.score_start(q.shape[2], score_window))
        if score_reduce == "mean":
            mass /= q.shape[1] // k.shape[1]
        return out, mass

    def narrow_decode_attention(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, slot: Tensor,
                                k_new: Tensor, v_new: Tensor, scale: float, *, want_scores: bool = False,
                                score_reduce: str = "sum", fmt=None,
                                col_start: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """ops.narrow_decode_attention's contract and values (to fp32 rounding) for an fp16 or quantized window
        whose (sequence, KV head) blocks of rows are contiguous, read in place (a quantized row dequantized in
        registers, csrc/decode_attention.cpp). col_start (b, g): k and v are a row pool (b, T, width) holding
        heads of different lengths, each column read from its own start (ops.TorchKernels)."""
        if col_start is None:
            rows_ok = k.dim() == 4 and k.stride(3) == 1 and k.stride(2) == k.shape[3]
            starts = torch.empty(0, dtype=torch.long)
        else:
            rows_ok = k.dim() == 3 and k.stride(2) == 1 and k.stride(1) == k.shape[2] and col_start.device.type == "cpu"
            starts = col_start
        rows_ok = rows_ok and self._cpu_fp32(q)
        mean = score_reduce == "mean"
        if rows_ok and fmt is not None and fmt.quantized and hasattr(self.ext, "decode_attention_quant"):
            quant = fmt.quant_for(q.shape[-1])
            out, mass = self.ext.decode_attention_quant(q, k, v, valid, slot, k_new, v_new, float(scale), want_scores,
                                                        mean, quant.bits, quant.group_size, starts)
            return out, (mass if want_scores else None)
        if rows_ok and k.dtype in (torch.float16, torch.float32):
            out, mass = self.ext.decode_attention(q, k, v, valid, slot, k_new, v_new, float(scale), want_scores, mean,
                                                  starts)
            return out, (mass if want_scores else None)
        return super().narrow_decode_attention(q, k, v, valid, slot, k_new, v_new, scale,
                                               want_scores=want_scores, score_reduce=score_reduce, fmt=fmt,
                                               col_start=col_start)

    def key_mass(self, q: Tensor, k: Tensor, valid: Tensor, slot: Tensor, k_new: Tensor, scale: float,
                 fmt) -> Tensor:
        """ops.TorchKernels.key_mass's values (to fp32 rounding): the compressed-cache kernel without its values."""
        quant = fmt.quant_for(q.shape[-1])
        if (self._cpu_fp32(q) and k.dim() == 4 and k.stride(3) == 1 and k.stride(2) == k.shape[3]
                and hasattr(self.ext, "decode_attention_quant")):
            none = torch.empty(0, dtype=torch.uint8)
            _, mass = self.ext.decode_attention_quant(q, k, none, valid, slot, k_new, k_new, float(scale), True,
                                                      False, quant.bits, quant.group_size, torch.empty(0, dtype=torch.long))
            return mass
        return super().key_mass(q, k, valid, slot, k_new, scale, fmt)

    def window_attention(self, q: Tensor, k: Tensor, v: Tensor, valid: Tensor, slot: Tensor, scale: float, *,
                         want_scores: bool = False, score_reduce: str = "sum") -> tuple[Tensor, Tensor | None]:
        """Batch-invariant: the decode kernel over the fp32 window, which reads only each column's own slots
        (the batched GEMMs of the torch ops block by the window's width, which the longest row sets)."""
        if (self.batch_invariant and self._cpu_fp32(q) and k.dtype == torch.float32 and k.dim() == 4
                and k.stride(3) == 1 and k.stride(2) == k.shape[3]):
            index = slot[:, :, None, None].expand(-1, -1, 1, k.shape[3])
            out, mass = self.ext.decode_attention(q, k, v, valid, slot, k.gather(2, index), v.gather(2, index),
                                                  float(scale), want_scores, score_reduce == "mean",
                                                  torch.empty(0, dtype=torch.long))
            return out, (mass if want_scores else None)
        return super().window_attention(q, k, v, valid, slot, scale, want_scores=want_scores,
                                        score_reduce=score_reduce)

    # --- the KV cache's commit ---

    def commit_usable(self, k: Tensor) -> bool:
        return (self.ext is not None and k.device.type == "cpu" and k.is_contiguous()
                and k.dtype in (torch.float16, torch.float32, torch.uint8))

    def commit_step(self, *args) -> None:
        """csrc/commit_step.cpp's commit_step (kv.cache.KVCache.commit_decode passes its arguments)."""
        self.ext.commit_step(*args)


def resolve(env: Mapping[str, str] | None = None, load: bool = True) -> Kernels:
    """The kernels for one engine, from the switches in `env` (default os.environ), read here only. load=False
    (an engine whose tensors are all on a GPU): torch ops, without building anything."""
    env = os.environ if env is None else env
    on = load and env.get(OFF_SWITCH, "1") != "0"
    return Kernels(build.load() if on else None, layer_math=env.get(LAYER_MATH_SWITCH, "1") != "0",
                   gemm=gemm_choice(env), batch_invariant=env.get(INVARIANT_SWITCH, "1") != "0")
